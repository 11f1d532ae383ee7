"""Train the MoE demo: a DeepSeek-V3-shaped target (latent attention, 8 routed experts top-2 plus one shared
expert, the first layer dense) with one multi-token-prediction (MTP) layer, on the codepair corpus with the
codepair tokenizer — the target of `method: mtp` and of expert parallelism benchmarks.

The MTP layer is trained beside the model as DeepSeek-V3 trains it: at position t it takes
eh_proj(cat(enorm(embed(token t+1)), hnorm(hidden_t))) — hidden_t the model's last hidden state after its
final norm — through a full decoder layer (MoE) and predicts token t+2 through shared_head (norm, head);
loss = LM loss + 0.3 x MTP loss. Saved in DeepSeek-V3's checkpoint layout: the MTP layer is
model.layers.{N}.* with N = num_hidden_layers, and config.json says num_nextn_predict_layers 1.

Usage: python benchmarks/train_moe_pair.py --pair .bench/codepair --corpus benchmarks/train_pair.py --out DIR
           [--minutes 3] [--tiny]
Writes DIR/target (config, weights, tokenizer), links DIR/tokenizer and DIR/draft to the pair's (so
benchmarks/offline.py --pair DIR runs draft_model too) and copies the held-out prompts; prints held-out loss
and the MTP layer's top-1 agreement with the model's own next-but-one prediction; writes train_report.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import shutil
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import training_corpus  # noqa: E402


def rms_norm(h: int) -> nn.Module:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    return DeepseekV3RMSNorm(h, eps=1e-6)


class MTP(nn.Module):
    """DeepSeek-V3's MTP module around a decoder layer of the model's own class (layer index N: sparse)."""

    def __init__(self, layer: nn.Module, hidden: int, vocab: int):
        super().__init__()
        self.enorm, self.hnorm = rms_norm(hidden), rms_norm(hidden)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer
        self.head_norm = rms_norm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, next_embeds, hidden, position_embeddings, mask):
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], -1))
        y = self.layer(x, attention_mask=mask, position_embeddings=position_embeddings)
        y = y[0] if isinstance(y, tuple) else y
        return self.head(self.head_norm(y))

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {prefix + "enorm.weight": self.enorm.weight, prefix + "hnorm.weight": self.hnorm.weight,
               prefix + "eh_proj.weight": self.eh_proj.weight, prefix + "shared_head.norm.weight": self.head_norm.weight,
               prefix + "shared_head.head.weight": self.head.weight}
        out.update({prefix + k: v for k, v in self.layer.state_dict().items()})
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--corpus", required=True, help="a train_pair.py defining corpus_files and encode_corpus")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--tiny", action="store_true", help="a few seconds on a small slice (a dry run)")
    a = ap.parse_args()
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(os.path.join(a.pair, "tokenizer"))
    data, held_data = training_corpus(a.corpus, tok, a.tiny, dev)

    N, hidden = (2, 64) if a.tiny else (4, 256)
    cfg = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, moe_intermediate_size=hidden,
        num_hidden_layers=N + 1, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=hidden // 4,
        qk_nope_head_dim=hidden // 8, qk_rope_head_dim=hidden // 16, v_head_dim=hidden // 8, rope_interleave=True,
        max_position_embeddings=4096, tie_word_embeddings=False, num_nextn_predict_layers=1,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = DeepseekV3ForCausalLM(cfg).to(dev)
    layers = model.model.layers
    model.model.layers = nn.ModuleList(list(layers)[:N])            # the model runs N layers; layer N is MTP's
    mtp = MTP(layers[N], hidden, len(tok)).to(dev)
    params = list(model.parameters()) + list(mtp.parameters())
    lr0 = 3e-3 if a.tiny else 1.5e-3
    opt = torch.optim.AdamW(params, lr=lr0, betas=(0.9, 0.95), weight_decay=0.1)
    seq, batch = (64, 4) if a.tiny else (512, 32)
    S = seq - 2
    mask = torch.full((seq, seq), float("-inf"), device=dev).triu(1).view(1, 1, seq, seq)

    def batch_of(src, g=None):
        idx = torch.randint(0, src.numel() - seq - 1, (batch,), device=dev, generator=g)
        return src[idx[:, None] + torch.arange(seq, device=dev)[None]].long()

    def losses(ids):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            h = model.model(input_ids=ids).last_hidden_state              # after the final norm
            logits = model.lm_head(h)
            pos = torch.arange(S, device=dev)[None].expand(ids.shape[0], -1)
            pe = model.model.rotary_emb(h, pos)
            m_logits = mtp(model.model.embed_tokens(ids[:, 1:S + 1]), h[:, :S], pe, mask[..., :S, :S])
        lm = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        mt = F.cross_entropy(m_logits.float().reshape(-1, m_logits.shape[-1]), ids[:, 2:S + 2].reshape(-1))
        # what drafting needs: the MTP layer's guess of token t+2 equals the model's own (greedy) guess there
        agree = (m_logits.argmax(-1) == logits[:, 1:S + 1].argmax(-1)).float().mean()
        return lm, mt, agree

    start, step, budget = time.time(), 0, (0.1 if a.tiny else a.minutes) * 60
    model.train()
    mtp.train()
    while time.time() - start < budget:
        frac = (time.time() - start) / budget
        for g in opt.param_groups:
            g["lr"] = lr0 * min(1, (step + 1) / 100) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        lm, mt, agree = losses(batch_of(data))
        opt.zero_grad(set_to_none=True)
        (lm + 0.3 * mt).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 100 == 0 or a.tiny:
            print(f"step {step} lm {lm.item():.3f} mtp {mt.item():.3f} agree {agree.item():.3f} "
                  f"t {time.time() - start:.0f}s", flush=True)
    model.eval()
    mtp.eval()
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        vals = [losses(batch_of(held_data, g)) for _ in range(10)]
    report = {"steps": step, "heldout_lm_loss": sum(v[0].item() for v in vals) / 10,
              "heldout_mtp_loss": sum(v[1].item() for v in vals) / 10,
              "heldout_mtp_top1_agree": sum(v[2].item() for v in vals) / 10}
    print(json.dumps(report), flush=True)
    save(a, model, mtp, layers, N, tok, report)


def save(a, model, mtp: MTP, layers, N: int, tok, report: dict) -> None:
    from safetensors.torch import save_file

    target = os.path.join(a.out, "target")
    os.makedirs(target, exist_ok=True)
    model.model.layers = nn.ModuleList(list(layers)[:N])
    model.config.num_hidden_layers = N
    model.to(torch.bfloat16).save_pretrained(target)
    tok.save_pretrained(target)
    weights = os.path.join(target, "model.safetensors")
    from safetensors.torch import load_file
    sd = load_file(weights)
    sd.update({k: v.detach().to(torch.bfloat16).cpu().contiguous()
               for k, v in mtp.checkpoint_tensors(f"model.layers.{N}.").items()})
    save_file(sd, weights, metadata={"format": "pt"})
    for name in ("tokenizer", "draft"):
        link = os.path.join(a.out, name)
        if not os.path.exists(link):
            os.symlink(os.path.abspath(os.path.join(a.pair, name)), link)
    shutil.copy(os.path.join(a.pair, "heldout_prompts.jsonl"), a.out)
    with open(os.path.join(a.out, "train_report.json"), "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
