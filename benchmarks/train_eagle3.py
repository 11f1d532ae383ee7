"""Train an EAGLE-3 head for a target and save it in the layout vLLM's llama_eagle3 reads (and specdp's
`method: eagle3` runs): `fc.weight` [h, 3h] over the residual streams entering three target layers,
`midlayer.*` (q/k/v over [input_layernorm(embedding), hidden_norm(feature)], 2h wide), `norm.weight`,
`lm_head.weight` over the draft vocabulary and `d2t` (draft id -> target id offsets), and a Llama
config.json with `eagle_aux_hidden_state_layer_ids` (vLLM's default (2, N // 2, N - 3) unless given).

Training follows EAGLE-3: the loss is the cross-entropy against the target's next-token distribution
(no feature regression), and a "training-time test" unroll teaches the chain: the second step takes
the head's own output stream as its feature and attends over the first step's keys, as drafting
step 2 does at inference. The draft vocabulary is the target's (codepair's 8,192 ids; d2t all zeros).

Usage (the corpus split of the codepair pair: `corpus_files` / `encode_corpus` from its train_pair.py,
which also made the held-out prompts):
  python benchmarks/train_eagle3.py --pair .bench/codepair --corpus benchmarks/train_pair.py --out .bench/codepair/eagle3
      [--minutes 4] [--aux 2,4,5] [--tiny]
Prints held-out top-1 agreement with the target at drafting steps 1 and 2; writes train_report.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import training_corpus  # noqa: E402


def rms(x, w, eps):
    return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Eagle3Trainee(nn.Module):
    """The EAGLE-3 head as a plain module (parallel over a sequence; `step` runs one drafting step)."""

    def __init__(self, cfg, n_aux: int, lm_head: torch.Tensor):
        super().__init__()
        h, H, KV = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        D = getattr(cfg, "head_dim", None) or h // H
        self.H, self.KV, self.D, self.eps = H, KV, D, cfg.rms_norm_eps
        lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = lin(n_aux * h, h)
        self.q, self.k, self.v, self.o = lin(2 * h, H * D), lin(2 * h, KV * D), lin(2 * h, KV * D), lin(H * D, h)
        self.gate, self.up, self.down = lin(h, cfg.intermediate_size), lin(h, cfg.intermediate_size), lin(cfg.intermediate_size, h)
        self.in_norm, self.hidden_norm, self.post_norm, self.norm = (nn.Parameter(torch.ones(h)) for _ in range(4))
        self.lm_head = nn.Parameter(lm_head.detach().clone())
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        self.rotary = LlamaRotaryEmbedding(cfg)

    def step(self, emb, feat, pos, mask, past=None):
        """emb, feat [B, T, h] at positions pos [B, T]; mask [T, S] over (past keys, own keys);
        returns (stream before norm [B, T, h], logits [B, T, V], (k, v) of this step)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        B, T, _ = emb.shape
        x = torch.cat([rms(emb, self.in_norm, self.eps), rms(feat, self.hidden_norm, self.eps)], -1)
        q = self.q(x).view(B, T, self.H, self.D).transpose(1, 2)
        k = self.k(x).view(B, T, self.KV, self.D).transpose(1, 2)
        v = self.v(x).view(B, T, self.KV, self.D).transpose(1, 2)
        cos, sin = self.rotary(x, pos)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, vals = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        rep = self.H // self.KV
        att = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1),
                                             attn_mask=mask)
        r = feat + self.o(att.transpose(1, 2).reshape(B, T, -1))
        r = r + self.down(F.silu(self.gate(rms(r, self.post_norm, self.eps))) * self.up(rms(r, self.post_norm, self.eps)))
        return r, rms(r, self.norm, self.eps) @ self.lm_head.T, (k, v)

    def state_dict_eagle3(self) -> dict[str, torch.Tensor]:
        m = "midlayer."
        return {"fc.weight": self.fc.weight, m + "self_attn.q_proj.weight": self.q.weight,
                m + "self_attn.k_proj.weight": self.k.weight, m + "self_attn.v_proj.weight": self.v.weight,
                m + "self_attn.o_proj.weight": self.o.weight, m + "mlp.gate_proj.weight": self.gate.weight,
                m + "mlp.up_proj.weight": self.up.weight, m + "mlp.down_proj.weight": self.down.weight,
                m + "input_layernorm.weight": self.in_norm, m + "hidden_norm.weight": self.hidden_norm,
                m + "post_attention_layernorm.weight": self.post_norm, "norm.weight": self.norm,
                "lm_head.weight": self.lm_head}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--corpus", required=True, help="a train_pair.py defining corpus_files and encode_corpus")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--aux", default="", help="target layer ids, e.g. 2,4,5 (default: vLLM's)")
    ap.add_argument("--tiny", action="store_true", help="a few seconds on a small slice (a dry run)")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(os.path.join(a.pair, "tokenizer"))
    tgt = AutoModelForCausalLM.from_pretrained(os.path.join(a.pair, "target"), dtype=torch.float32).to(dev).eval()
    for p in tgt.parameters():
        p.requires_grad_(False)
    N = tgt.config.num_hidden_layers
    aux = tuple(int(x) for x in a.aux.split(",")) if a.aux else (2, N // 2, N - 3)
    data, held_data = training_corpus(a.corpus, tok, a.tiny, dev)
    cfg = LlamaConfig(**{k: v for k, v in tgt.config.to_dict().items() if k in LlamaConfig().to_dict()})
    cfg.num_hidden_layers = 1
    head = Eagle3Trainee(cfg, len(aux), tgt.get_output_embeddings().weight).to(dev)
    emb = tgt.get_input_embeddings()
    lr0 = 3e-3 if a.tiny else 1e-3
    opt = torch.optim.AdamW(head.parameters(), lr=lr0, betas=(0.9, 0.95), weight_decay=0.0)
    seq, batch = (64, 4) if a.tiny else (512, 64)
    before_norm: list[torch.Tensor] = []
    tgt.model.norm.register_forward_hook(lambda _m, args, _o: before_norm.append(args[0]))
    T = seq - 2                                    # positions with a next and a next-but-one token
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    # step 2 at slot t (position t + 1): step-1 keys of positions <= t, and its own key
    ttt = torch.cat([causal, torch.eye(T, dtype=torch.bool, device=dev)], 1)

    def batch_of(src, g=None):
        idx = torch.randint(0, src.numel() - seq - 1, (batch,), device=dev, generator=g)
        return src[idx[:, None] + torch.arange(seq, device=dev)[None]].long()

    def losses(ids):
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            before_norm.clear()
            out = tgt(input_ids=ids, output_hidden_states=True)
            hs = list(out.hidden_states[:N]) + [before_norm[0]]
            feats_in = torch.cat([hs[j] for j in aux], -1).float()
            p_next = F.softmax(out.logits.float(), -1)           # target's distribution of the token after each position
        pos = torch.arange(T, device=dev)[None].expand(ids.shape[0], -1)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            f1 = head.fc(feats_in[:, :T])                                     # features of positions 0..T-1
            r1, logits1, kv1 = head.step(emb(ids[:, 1:T + 1]), f1, pos, causal)
            _, logits2, _ = head.step(emb(ids[:, 2:T + 2]), r1, pos + 1, ttt, past=kv1)
        l1 = -(p_next[:, 1:T + 1] * F.log_softmax(logits1.float(), -1)).sum(-1).mean()
        l2 = -(p_next[:, 2:T + 2] * F.log_softmax(logits2.float(), -1)).sum(-1).mean()
        agree1 = (logits1.argmax(-1) == p_next[:, 1:T + 1].argmax(-1)).float().mean()
        agree2 = (logits2.argmax(-1) == p_next[:, 2:T + 2].argmax(-1)).float().mean()
        return l1, l2, agree1, agree2

    start, step, budget = time.time(), 0, (0.1 if a.tiny else a.minutes) * 60
    while time.time() - start < budget:
        frac = (time.time() - start) / budget
        for g in opt.param_groups:
            g["lr"] = lr0 * min(1, (step + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        l1, l2, ag1, ag2 = losses(batch_of(data))
        loss = l1 + 0.8 * l2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        step += 1
        if step % 200 == 0 or a.tiny:
            print(f"step {step} loss {l1.item():.3f} / {l2.item():.3f} top1 {ag1.item():.3f} / {ag2.item():.3f} "
                  f"t {time.time() - start:.0f}s", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        vals = [losses(batch_of(held_data, g)) for _ in range(10)]
    report = {"steps": step, "aux_layers": list(aux),
              "heldout_top1_agree_step1": sum(v[2].item() for v in vals) / 10,
              "heldout_top1_agree_step2": sum(v[3].item() for v in vals) / 10}
    print(json.dumps(report), flush=True)
    os.makedirs(a.out, exist_ok=True)
    d = cfg.to_dict()
    d.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=cfg.vocab_size,
             eagle_aux_hidden_state_layer_ids=list(aux), dtype="bfloat16")
    d.pop("_attn_implementation", None)
    with open(os.path.join(a.out, "config.json"), "w") as fh:
        json.dump(d, fh, indent=1)
    from safetensors.torch import save_file
    sd = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in head.state_dict_eagle3().items()}
    sd["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
    save_file(sd, os.path.join(a.out, "model.safetensors"))
    with open(os.path.join(a.out, "train_report.json"), "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
