"""Train the MoE demo: a DeepSeek-V3-shaped target (latent attention, 8 routed experts top-2 plus one shared
expert, the first layer dense) with one multi-token-prediction (MTP) layer, on the codepair corpus with the
codepair tokenizer — the target of `method: mtp` and of expert parallelism benchmarks — and its drafters as a
user would train them for it.

1. The target, `--minutes`: the MTP layer is trained beside the model as DeepSeek-V3 trains it — at position t
   it takes eh_proj(cat(enorm(embed(token t+1)), hnorm(hidden_t))), hidden_t the model's last hidden state after
   its final norm, through a full decoder layer (MoE) and predicts token t+2 through shared_head (norm, head) —
   and also as specdp drafts with it for k >= 2: step d feeds back step d-1's layer output with token t+d's
   embedding and predicts token t+d+1 (benchmarks/moe_drafters.py). loss = LM loss + sum of w_d x step d's loss
   (`--mtp-weights`, default 0.3 each for steps 1..3).
2. The draft model, `--draft-minutes`, the target frozen: the codepair draft model (same tokenizer: its
   weights are the start) is distilled from this target — KL(target || draft) of the next-token distribution,
   temperature 1, on the same corpus batches.
Saved in DeepSeek-V3's checkpoint layout: the MTP layer is model.layers.{N}.* with N = num_hidden_layers, and
config.json says num_nextn_predict_layers 1.

Usage: python benchmarks/train_moe_pair.py --pair .bench/codepair --corpus benchmarks/train_pair.py --out DIR
           [--minutes 3] [--draft-minutes 1.5] [--mtp-weights 0.3,0.3,0.3] [--tiny]
Writes DIR/target (config, weights, tokenizer), DIR/draft (the distilled draft: a Llama checkpoint with the
tokenizer), links DIR/tokenizer to the pair's (so benchmarks/offline.py --pair DIR runs draft_model and mtp) and
copies the held-out prompts; prints held-out loss and each drafter's top-1 agreement with the target's greedy
next token — on held-out text, and on the target's own greedy continuations of it with the acceptance those
give at k = 1..4 (MTP: per step, k = 1..3) — for the codepair draft before and the distilled draft after;
writes train_report.json.
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
from moe_drafters import (MTP, chain_logits, draft_on_continuations, greedy_continuations, kl_to_target,  # noqa: E402
                          mtp_on_continuations)
from workloads import training_corpus  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--corpus", required=True, help="a train_pair.py defining corpus_files and encode_corpus")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=3.0, help="the target's (and its MTP layer's) training")
    ap.add_argument("--draft-minutes", type=float, default=1.5,
                    help="then the draft model's distillation from the trained target")
    ap.add_argument("--mtp-weights", default="0.3,0.3,0.3",
                    help="the MTP loss weight of each recursive step 1, 2, ... (their count: the steps trained)")
    ap.add_argument("--tiny", action="store_true", help="a few seconds on a small slice (a dry run)")
    a = ap.parse_args()
    from transformers import AutoTokenizer, LlamaForCausalLM

    try:
        weights = [float(w) for w in a.mtp_weights.split(",")]
    except ValueError:
        sys.exit(f"--mtp-weights {a.mtp_weights!r}: give comma-separated numbers, e.g. 0.3,0.3,0.3")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(os.path.join(a.pair, "tokenizer"))
    data, held_data = training_corpus(a.corpus, tok, a.tiny, dev)
    print(f"corpus: {data.numel() / 1e6:.1f}M train tokens, {held_data.numel() / 1e6:.2f}M held out "
          f"({time.time() - t0:.0f} s)", flush=True)
    model, mtp, N = build_target(tok, a.tiny, dev)
    seq, batch = (64, 4) if a.tiny else (512, 32)

    def batch_of(src, g=None):
        idx = torch.randint(0, src.numel() - seq - 1, (batch,), device=dev, generator=g)
        return src[idx[:, None] + torch.arange(seq, device=dev)[None]].long()

    report = {"steps": train_target(model, mtp, weights, lambda: batch_of(data), 0.1 if a.tiny else a.minutes, a.tiny)}
    g = torch.Generator(device=dev).manual_seed(0)
    held = [batch_of(held_data, g) for _ in range(2 if a.tiny else 10)]
    report.update(eval_target(model, mtp, held, len(weights)))
    # the target's own greedy continuations of held-out text: what the drafters meet when the demo decodes
    P, G = (32, 16) if a.tiny else (128, 128)
    prompts = torch.cat([h[:, :P] for h in held])[:8 if a.tiny else 64]
    with torch.no_grad(), autocast(dev):
        cont = greedy_continuations(lambda ids: model.lm_head(model.model(input_ids=ids).last_hidden_state[:, -1]),
                                    prompts, G)
    report["mtp"] = eval_drafters(model, mtp, None, held, cont, P, len(weights))
    report["heldout_mtp_top1_agree"] = report["mtp"]["heldout_top1_agree_by_step"][0]
    report["seconds_to_target_trained"] = round(time.time() - t0, 1)
    draft = LlamaForCausalLM.from_pretrained(os.path.join(a.pair, "draft"), dtype=torch.float32).to(dev)
    report["draft_before"] = eval_drafters(model, None, draft, held, cont, P, len(weights))
    report["draft_steps"] = distill_draft(model, draft, lambda: batch_of(data), 0.1 if a.tiny else a.draft_minutes)
    report["draft_after"] = eval_drafters(model, None, draft, held, cont, P, len(weights))
    report["continuations"] = {"prompts": prompts.shape[0], "prompt_tokens": P, "new_tokens": G}
    report["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(report), flush=True)
    save(a, model, mtp, N, draft, tok, report)


def autocast(dev: torch.device):
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


def build_target(tok, tiny: bool, dev: torch.device):
    """The DeepSeek-V3-shaped target (N decoder layers; tiny: 2 of hidden 64) and its MTP layer (layer N)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    N, hidden = (2, 64) if tiny else (4, 256)
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
    model.config.num_hidden_layers = N
    model.config.use_cache = False          # every forward here is a whole sequence (save() turns it back on)
    return model, MTP(layers[N], hidden, len(tok)).to(dev), N


def cosine_lr(opts_lr0, step: int, frac: float, warm: int) -> None:
    """Warm-up over `warm` steps, then a cosine from lr0 to lr0 / 10 over the time budget."""
    for opt, lr0 in opts_lr0:
        for g in opt.param_groups:
            g["lr"] = lr0 * min(1, (step + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def target_losses(model, mtp, ids, weights):
    """The LM loss, each MTP step's loss against the text, and step 1's top-1 agreement with the model's own
    greedy prediction of the same token."""
    D = len(weights)
    with autocast(ids.device):
        h = model.model(input_ids=ids).last_hidden_state              # after the final norm
        logits = model.lm_head(h)
        steps = chain_logits(mtp, model, ids, h, D)
    S = ids.shape[1] - D - 1
    lm = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    mt = [F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), ids[:, d + 1:S + d + 1].reshape(-1))
          for d, lg in enumerate(steps, 1)]
    agree = (steps[0].argmax(-1) == logits[:, 1:S + 1].argmax(-1)).float().mean()
    return lm, mt, agree


def train_target(model, mtp, weights, next_batch, minutes: float, tiny: bool) -> int:
    """The target with its MTP layer beside it, as DeepSeek-V3 trains them (the MTP loss reaches the trunk),
    with the MTP layer applied recursively for steps 2..D as specdp drafts with it. Returns the steps."""
    params = list(model.parameters()) + list(mtp.parameters())
    lr0 = 3e-3 if tiny else 1.5e-3
    opt = torch.optim.AdamW(params, lr=lr0, betas=(0.9, 0.95), weight_decay=0.1)
    start, step, budget = time.time(), 0, minutes * 60
    model.train()
    mtp.train()
    while time.time() - start < budget:
        cosine_lr([(opt, lr0)], step, (time.time() - start) / budget, 100)
        lm, mt, agree = target_losses(model, mtp, next_batch(), weights)
        opt.zero_grad(set_to_none=True)
        (lm + sum(w * m for w, m in zip(weights, mt))).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 100 == 0 or tiny:
            print(f"step {step} lm {lm.item():.3f} mtp {' '.join(f'{m.item():.3f}' for m in mt)} "
                  f"agree {agree.item():.3f} t {time.time() - start:.0f}s", flush=True)
    model.eval()
    mtp.eval()
    return step


@torch.no_grad()
def eval_target(model, mtp, held, D: int) -> dict:
    vals = [target_losses(model, mtp, ids, [1.0] * D) for ids in held]
    by_step = [sum(v[1][d].item() for v in vals) / len(vals) for d in range(D)]
    return {"heldout_lm_loss": sum(v[0].item() for v in vals) / len(vals), "heldout_mtp_loss": by_step[0],
            "heldout_mtp_loss_by_step": by_step}


def distill_draft(model, draft, next_batch, minutes: float) -> int:
    """The target frozen, on the same corpus batches: the draft model learns the target's next-token
    distribution, KL(target || draft) at temperature 1. Returns the steps."""
    lr0 = 1e-3
    opt = torch.optim.AdamW(draft.parameters(), lr=lr0, betas=(0.9, 0.95), weight_decay=0.1)
    start, step, budget = time.time(), 0, minutes * 60
    draft.train()
    while time.time() - start < budget:
        cosine_lr([(opt, lr0)], step, (time.time() - start) / budget, 50)
        ids = next_batch()
        with autocast(ids.device):
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            kd = kl_to_target(draft(input_ids=ids).logits, logits)
        opt.zero_grad(set_to_none=True)
        kd.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0 or budget < 10:
            print(f"draft step {step} kl {kd.item():.3f} t {time.time() - start:.0f}s", flush=True)
    draft.eval()
    return step


@torch.no_grad()
def eval_drafters(model, mtp, draft, held, cont, P: int, D: int) -> dict:
    """A drafter's top-1 agreement with the target's greedy next token on held-out text (each MTP step's,
    its inputs the text's tokens), and on the target's own greedy continuations (cont, prompt P) with the
    acceptance those would give at k = 1..4 (MTP: 1..D)."""
    with autocast(cont.device):
        if draft is not None:
            agree = [(draft(input_ids=ids).logits.argmax(-1) == model(input_ids=ids).logits.argmax(-1)).float().mean()
                     for ids in held]
            out = {"heldout_top1_agree": round(sum(a.item() for a in agree) / len(agree), 4),
                   "continuations": draft_on_continuations(draft, cont, P)}
        else:
            by_step = torch.zeros(D)
            for ids in held:
                h = model.model(input_ids=ids).last_hidden_state
                logits, S = model.lm_head(h), ids.shape[1] - D - 1
                for d, lg in enumerate(chain_logits(mtp, model, ids, h, D), 1):
                    by_step[d - 1] += (lg.argmax(-1) == logits[:, d:S + d].argmax(-1)).float().mean().item()
            out = {"heldout_top1_agree_by_step": [round(v, 4) for v in (by_step / len(held)).tolist()],
                   "continuations": mtp_on_continuations(mtp, model, cont, P, D)}
    print(("draft " if draft is not None else "mtp ") + json.dumps(out), flush=True)
    return out


def save(a, model, mtp: MTP, N: int, draft, tok, report: dict) -> None:
    """DIR/target (the MTP layer as model.layers.{N}.*), DIR/draft (the distilled draft model, a real directory),
    DIR/tokenizer (a link to the pair's), the held-out prompts and train_report.json."""
    from safetensors.torch import load_file, save_file

    target = os.path.join(a.out, "target")
    os.makedirs(target, exist_ok=True)
    model.config.use_cache = True
    model.to(torch.bfloat16).save_pretrained(target)
    tok.save_pretrained(target)
    weights = os.path.join(target, "model.safetensors")
    sd = load_file(weights)
    sd.update({k: v.detach().to(torch.bfloat16).cpu().contiguous()
               for k, v in mtp.checkpoint_tensors(f"model.layers.{N}.").items()})
    save_file(sd, weights, metadata={"format": "pt"})
    dpath = os.path.join(a.out, "draft")
    if os.path.islink(dpath):           # earlier versions of this script linked the pair's draft here
        os.remove(dpath)
    draft.to(torch.bfloat16).save_pretrained(dpath)
    tok.save_pretrained(dpath)
    link = os.path.join(a.out, "tokenizer")
    if not os.path.exists(link):
        os.symlink(os.path.abspath(os.path.join(a.pair, "tokenizer")), link)
    shutil.copy(os.path.join(a.pair, "heldout_prompts.jsonl"), a.out)
    with open(os.path.join(a.out, "train_report.json"), "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
