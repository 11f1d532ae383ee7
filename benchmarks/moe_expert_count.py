"""Routed compute on CPU: the same Qwen3-MoE-shaped model (random weights, float32) with 8 and with 128 experts
(top 2 either way, so a token's work is the same), through specdp's engine in one process: with only the
chosen experts computed the 128-expert model should cost about what the 8-expert one does; the previous
engine's MoE (every expert over every token, `--all-experts`) costs ~16x more there.

Usage: python benchmarks/moe_expert_count.py [--experts 8,128] [--batch 4] [--new 32] [--repeats 3] [--all-experts]
           --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offline  # noqa: E402

from specdp_cli.runtime.models.moe import MoE  # noqa: E402

TOKENIZER = os.path.join(ROOT, "demo", "pair", "target")


def build_model(path: str, experts: int, a) -> None:
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=a.hidden // 4, num_experts=experts, num_experts_per_tok=a.top_k,
                         moe_intermediate_size=a.width, intermediate_size=4 * a.hidden, norm_topk_prob=True,
                         max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=None,
                         pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)                # routing spread over the experts
    model.save_pretrained(path)
    tok.save_pretrained(path)


def all_experts(self: MoE, x, w, held):
    """The previous engine's MoE: every held expert over every token, weighted (0 where not chosen)."""
    out = torch.zeros_like(x)
    for j in range(self.gate_up.shape[0]):
        we = (w * (held == j)).sum(-1, keepdim=True)
        out += (self.expert(x, j) * we).to(x.dtype)
    return out


def timed_run(path: str, prompts, a) -> tuple[float, list]:
    engine = offline.engine_from({"model": path, "dtype": "float32", "device": "cpu", "max_model_len": 512,
                                  "speculative": {"method": "none"}, "scheduler": {"max_num_seqs": a.batch}})
    times, outs = [], None
    for _ in range(a.repeats):
        done, secs = offline.run(engine, prompts, a.new)
        times.append(secs)
        outs = [done[i].generated for i in range(len(prompts))]
    return statistics.median(times), outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", default="8,128")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--all-experts", action="store_true", help="also time the previous engine's MoE")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for E in [int(e) for e in a.experts.split(",")]:
            path = os.path.join(tmp, f"e{E}")
            build_model(path, E, a)
            modes = [("routed", None)] + ([("all experts (before)", all_experts)] if a.all_experts else [])
            for mode, patch in modes:
                saved = MoE.routed_reference
                if patch is not None:
                    MoE.routed_reference = patch
                try:
                    secs, outs = timed_run(path, prompts, a)
                finally:
                    MoE.routed_reference = saved
                rows.append({"experts": E, "top_k": a.top_k, "mode": mode, "s": secs,
                             "tok_s": sum(map(len, outs)) / secs, "outputs": outs})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "outputs"}), flush=True)
    base = {r["mode"]: r["s"] for r in rows if r["experts"] == int(a.experts.split(",")[0])}
    print(f"{'experts':>8}  {'mode':<22}{'s':>8}{'tok/s':>9}{'x time of first':>17}")
    for r in rows:
        r["ratio_to_first"] = r["s"] / base[r["mode"]]
        print(f"{r['experts']:>8}  {r['mode']:<22}{r['s']:>8.3f}{r['tok_s']:>9.1f}{r['ratio_to_first']:>17.2f}")
    by = {(r["experts"], r["mode"]): r["outputs"] for r in rows}
    for E in {r["experts"] for r in rows}:
        if (E, "all experts (before)") in by:
            print(f"{E} experts: routed tokens equal the previous path's: {by[(E, 'routed')] == by[(E, 'all experts (before)')]}")
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "argv": sys.argv[1:]}
    with open(a.json, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
