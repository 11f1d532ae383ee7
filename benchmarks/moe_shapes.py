"""Mixture-of-experts targets at real expert counts, random weights, through specdp's engine and Hugging Face's
generate in the same run: decode tok/s at several batch sizes against the weight-read limit.

Shapes (the codepair tokenizer's vocabulary, so the held-out prompts apply):
- qwen3_30b_a3b: Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, 128 experts top-8 of width
  768), 8 layers.
- deepseek_v3: DeepSeek-V3's layer (hidden 7168, latent attention with 128 heads, q_lora 1536, kv_lora 512,
  256 routed experts top-8 of width 2048 in 8 groups (top 4 groups), one shared expert), the first layer dense
  (width 18432), `--deepseek-layers` layers in all (2 by default: 24 GB, what fits beside Hugging Face's copy).

The limit at batch B: one step of B tokens reads every weight but the routed experts', plus the routed experts
the B tokens choose — with routing spread evenly, E * (1 - (1 - k/E)^B) distinct experts per MoE layer — and
the device copies bytes at the measured copy bandwidth; limit tok/s = B / (bytes / bandwidth). At batch 1 that
is the active-weight limit. Rows are medians of `--repeats` runs of `offline.py`'s loop (greedy, `none`): tok/s
= new tokens / the run's time, prompts cut to `--prompt-len` tokens so that decoding dominates the time.

Usage: python benchmarks/moe_shapes.py --pair .bench/codepair --work /tmp/moe_shapes [--shapes qwen3_30b_a3b,
           deepseek_v3] [--batches 1,16,64] [--new 128] [--prompt-len 32] [--repeats 3] [--hf-batches 1] [--profile 1] --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_baselines as hb  # noqa: E402
import offline  # noqa: E402
from workloads import heldout  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def hf_config(shape: str, vocab: int, deepseek_layers: int, tiny: bool = False):
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    common = dict(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0,
                  eos_token_id=None, pad_token_id=0, rms_norm_eps=1e-6)
    if tiny:        # a dry run of the script (CPU is fine): the same families, small
        if shape == "qwen3_30b_a3b":
            return Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=32,
                                  intermediate_size=128, norm_topk_prob=True, **common)
        return DeepseekV3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                v_head_dim=16, n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
                                n_shared_experts=1, moe_intermediate_size=32, intermediate_size=128,
                                first_k_dense_replace=1, norm_topk_prob=True, **common)
    if shape == "qwen3_30b_a3b":
        return Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                              head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                              intermediate_size=6144, norm_topk_prob=True, **common)
    return DeepseekV3Config(hidden_size=7168, num_hidden_layers=deepseek_layers, num_attention_heads=128,
                            num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                            n_group=8, topk_group=4, n_shared_experts=1, moe_intermediate_size=2048,
                            intermediate_size=18432, first_k_dense_replace=1, routed_scaling_factor=2.5,
                            norm_topk_prob=True, **common)


def build(shape: str, a, tok):
    """The random model on the GPU (Hugging Face's), saved as a checkpoint at work/shape/target."""
    pair = os.path.join(a.work, shape)
    cfg = hf_config(shape, len(tok), a.deepseek_layers, a.tiny)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, 1.0)
    if not os.path.exists(os.path.join(pair, "target", "config.json")):
        os.makedirs(pair, exist_ok=True)
        model.save_pretrained(os.path.join(pair, "target"))
        tok.save_pretrained(os.path.join(pair, "target"))
        for name in ("tokenizer", "draft"):
            if not os.path.exists(os.path.join(pair, name)):
                os.symlink(os.path.abspath(os.path.join(a.pair, name)), os.path.join(pair, name))
        with open(os.path.join(pair, "heldout_prompts.jsonl"), "w") as fh:
            for p in heldout(a.pair):
                fh.write(json.dumps({"prompt": p}) + "\n")
    print(f"{shape}: built in {time.perf_counter() - t:.1f} s", flush=True)
    return model, pair


def step_bytes(model, shape: str, B: int) -> tuple[int, int, int]:
    """(bytes a step of B tokens reads, bytes of all weights, bytes of the routed experts of one token)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    E = cfg.num_experts if shape == "qwen3_30b_a3b" else cfg.n_routed_experts
    k = cfg.num_experts_per_tok
    routed = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if ".experts." in n and "shared" not in n)
    embed = model.get_input_embeddings().weight
    rest = total - routed - embed.numel() * embed.element_size()       # an embedding row per token: negligible
    used = E * (1 - (1 - k / E) ** B)
    return int(rest + routed * used / E), total, int(routed * k / E)


def hf_row(model, tok, prompts, B: int, new: int) -> dict:
    """Hugging Face's generate, greedy, static batches of B prompts (hf_baselines.run_batched), tok/s."""
    hb.run_batched(model, tok, prompts[:B], 4, B)                          # warm-up
    _, n, secs = hb.run_batched(model, tok, prompts[:B], new, B)
    return {"tok_s": n / secs, "s": secs}


def engine_rows(a, shape: str, pair: str, mode: str, prompts, batches, limits, bw) -> list[dict]:
    """specdp's rows of one shape, scheduler.async_scheduling `mode` (auto, on, off)."""
    ns = SimpleNamespace(pair=pair, target=None, dtype="bfloat16", max_model_len=a.max_model_len, k=1,
                         max_batched_tokens=8192, async_scheduling={"auto": None, "on": True, "off": False}[mode])
    t = time.perf_counter()
    engine = offline.build(ns, "none", False, max(batches))
    build_s = time.perf_counter() - t
    rows = []
    for B in batches:
        engine.scheduler.max_num_seqs = B
        offline.run(engine, prompts[:B], 4)                         # warm-up
        runs = []
        for _ in range(a.repeats):
            done, secs = offline.run(engine, prompts[:B], a.new)
            runs.append(sum(len(s.generated) for s in done.values()) / secs)
        step, total, active_routed = limits[B]
        limit = B / (step / bw) if bw else None
        med = statistics.median(runs)
        rows.append({"shape": shape, "engine": "specdp" + (" sync" if mode == "off" else ""), "batch": B, "tok_s": med,
                     "runs": runs, "async_scheduling": engine.async_sched, "step_bytes": step, "weight_bytes": total,
                     "active_routed_bytes": active_routed, "limit_tok_s": limit,
                     "pct_of_limit": med / limit * 100 if limit else None, "build_s": build_s, "graphs": engine.graphs})
        print(json.dumps(rows[-1]), flush=True)
        if str(B) in a.profile.split(","):
            tag = "" if mode in ("auto", "on") else "_sync"
            offline.profile(engine, prompts[:B], a.new,
                            trace=f"{a.trace}_{shape}_b{B}{tag}.json" if a.trace else None)
    del engine
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True, help="the codepair directory (tokenizer, held-out prompts)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--hf-batches", default="1")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32, help="prompts cut to this many tokens: decode dominates")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--deepseek-layers", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="small models of the same families: a dry run")
    ap.add_argument("--profile", default="", help="batch sizes to profile a few steps of (torch.profiler tables)")
    ap.add_argument("--trace", default="", help="with --profile: a Chrome trace per profiled batch, this path + _bB.json")
    ap.add_argument("--async-scheduling", default="auto",
                    help="scheduler.async_scheduling: auto (on on a GPU), on, off, or on,off for rows of both")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(a.pair, "tokenizer"))
    batches = [int(b) for b in a.batches.split(",")]
    bw = offline.copy_bandwidth()
    rows = []
    for shape in a.shapes.split(","):
        model, pair = build(shape, a, tok)
        need = max(batches)
        texts = (heldout(a.pair) * (need // len(heldout(a.pair)) + 1))[:need]
        prompts = [tok(t)["input_ids"][:a.prompt_len] for t in texts]
        limits = {B: step_bytes(model, shape, B) for B in batches}
        for B in [int(b) for b in a.hf_batches.split(",") if b]:
            r = hf_row(model, tok, [tok.decode(p) for p in prompts], B, min(a.new, 32))
            rows.append({"shape": shape, "engine": "hf generate", "batch": B, **r})
            print(json.dumps(rows[-1]), flush=True)
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        for mode in a.async_scheduling.split(","):
            rows += engine_rows(a, shape, pair, mode, prompts, batches, limits, bw)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "copy_bandwidth_Bps": bw, "new_tokens": a.new,
            "argv": sys.argv[1:]}
    with open(a.json, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"{'shape':<15}{'engine':<13}{'batch':>6}{'tok/s':>10}{'limit':>10}{'% limit':>9}{'GB/step':>9}")
    for r in rows:
        lim = (f"{r['limit_tok_s']:>10.0f}{r['pct_of_limit']:>9.1f}{r['step_bytes'] / 1e9:>9.2f}"
               if r.get("limit_tok_s") else "")
        print(f"{r['shape']:<15}{r['engine']:<13}{r['batch']:>6}{r['tok_s']:>10.1f}{lim}")
    hf = {(r["shape"], r["batch"]): r["tok_s"] for r in rows if r["engine"] == "hf generate"}
    for r in rows:
        if r["engine"] == "specdp" and (r["shape"], r["batch"]) in hf:
            print(f"{r['shape']} batch {r['batch']}: specdp / Hugging Face = {r['tok_s'] / hf[(r['shape'], r['batch'])]:.1f}x")
    if bw:
        print(f"device copy bandwidth {bw / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
