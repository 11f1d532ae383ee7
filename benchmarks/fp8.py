"""FP8 against bf16 end to end: the same target loaded as stored (bf16) and with `quantization: fp8` (its linear
layers quantized at load to 128 x 128 block FP8, computed as W8A8), greedy, through offline.py's engine loop;
`none` (target-only decoding) and, with --methods none,draft_model, the pair's bf16 draft model proposing k tokens
(the speed-up over `none` with an FP8 target: issue 30's "kept"). Per method and batch size a row per quantization:
tok/s as the median of --repeats runs, and for FP8 the greedy agreement with bf16 at the same method and batch size
(share of prompts whose tokens are identical, and where the others first diverge).

Targets: --target DIR (e.g. the 8B shape, benchmarks/widen.py), or --moe-shape qwen3_30b_a3b (built at random by
moe_shapes.py into --work; prompts cut to --prompt-len tokens so decoding dominates).

Usage: python benchmarks/fp8.py --pair .bench/codepair (--target DIR | --moe-shape qwen3_30b_a3b --work DIR)
           [--prompts 16] [--batches 1,16] [--new 128] [--repeats 3] [--trace PREFIX] [--methods none,draft_model]
           [--decode-modes quantize,quantize-s16,bf16-nosplit] --json OUT.json
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

import offline  # noqa: E402
from specdp_cli.runtime.engine import Engine  # noqa: E402
from workloads import heldout  # noqa: E402


def build(a, target: str, tokenizer: str, quantization: str | None, max_seqs: int, method: str) -> tuple[Engine, dict]:
    spec = {"method": "none"} if method == "none" else \
        {"method": method, "num_speculative_tokens": a.k, "model": os.path.join(a.pair, "draft")}
    engine = offline.engine_from({"model": target, "tokenizer": tokenizer, "dtype": "bfloat16", "device": "cuda",
                                  "max_model_len": a.max_model_len, "quantization": quantization,
                                  "speculative": spec,
                                  "scheduler": {"max_num_seqs": max_seqs, "max_num_batched_tokens": 8192}})
    return engine, engine.plan.memory


DEFAULTS: dict = {}        # settings apply_mode changes, as the package has them


def apply_mode(mode: str | None) -> None:
    """A row's kernel settings: "bf16" or an FP8 decode mode of fp8_kernels (quantize, fused, weight_only, gemv),
    then the changes switched off: "-unfused" (the activations quantized by their own kernel, not in the norm's),
    "-sumkernel" (split K summed by a second kernel, not by a tile's last program), "-nosplit" (decode attention in
    one pass, not split over the keys), "-s16" (all three: session 16's path), "-nopdl" (kernels launched plainly,
    not with programmatic dependent launch; runtime/pdl.py), "-noprefetch" (PDL without the GEMMs' weight prefetch),
    "-expertsplain" (PDL, but the routed-expert kernels launched plainly, as the GEMMs), "-s21" (session 21's path:
    "-nopdl"); "-cublas": cuBLAS's block-scaled GEMM from 65 rows (the Triton decode tiles up to 64); "-noverify":
    rows 65-127 on the prefill tile, not the verification rows' tiles (fp8_kernels.VERIFY_MAX_M; session 27's path);
    "-attnquant": o's input quantized by the attention kernel, not by its own (fp8_kernels.FUSE_ATTENTION_QUANT;
    the default since session 29), "-noattnquant": by its own; "-s28tiles": the decode tiles before session 29
    (fp8_kernels.DECODE_TILES_29); "-swapdecode" / "-swapverify" / "-swapall" / "-noswap": the GEMM computed
    transposed at 1-16 rows (the default since session 36) / 17-127 / 1-127 / none (fp8_kernels.SWAP_TILES);
    "-nocublas": verification rows never on cuBLAS (fp8_kernels.VERIFY_CUBLAS); "-expertsw8a8t" /
    "-noexpertsw8a8t": FP8 routed experts of few pairs W8A8 with the product transposed, or weight-only
    (moe_kernels.EXPERTS_W8A8T); "-ahead" / "-noahead": the FP8 GEMM's scales loaded one K block ahead, or in their
    block (fp8_kernels.SCALES_AHEAD; the default for the transposed decode tiles since session 37); "-noaddnorm":
    o and down's output joined to the residual stream and normed by the RMSNorm kernel, not by the GEMMs
    (fp8_kernels.FUSE_ADD_NORM; the default since session 37); "-noexpertsxq" / "-expertsxq": the FP8 routed
    experts' W8A8 gate/up kernel quantizes x itself, or reads it quantized by the RMSNorm before
    (moe_kernels.EXPERTS_X_Q; the default since session 39); "-addnormearly": the joining GEMM's residual tile and
    norm weight loaded before its main loop (fp8_kernels.ADD_NORM_EARLY; the default since session 38),
    "-noaddnormearly": in its last step. Not kept (slower or the same): session 39's "-upsplit2" / "-upsplit4" (that
    gate/up kernel's K split over 2 / 4 programs a tile; commit a9e9d38) and "-prefetchdown" (that kernel starting its
    expert's down weights on their way into L2; commit fcb2028) and "-up32" again (that kernel 32 columns a program,
    now with x quantized before; commit a907d28); session 38's silu_and_mul inside the gate_up
    GEMM (commit 6aa6ee7: "-glu64" / "-glu128" / "-glu256", its tile 64 / 128 / 256 weight rows, and "-noglu");
    session 37's split attention combined by each (row, KV head)'s last part to finish instead of the
    combine kernel (commit d799f2f, whose "-attncombine" rows have the combine kernel), "-expertsahead" (the scales
    a K block ahead in the FP8 routed experts) and "-up32" (their W8A8 gate/up kernel 32 columns a program; the code
    of these two is not in the repository); session
    36's "-w8a16v" / "-w8a16all" (W8A16 on the swapped tile, each weight tile dequantized before its product; commit
    5fdec1b)."""
    from specdp_cli.runtime import fp8_kernels, moe_kernels, pdl, triton_kernels
    for name in ("CUBLAS_FROM_M", "VERIFY_MAX_M", "FUSE_ATTENTION_QUANT", "DECODE_TILES_29", "SWAP_TILES",
                 "VERIFY_CUBLAS"):
        DEFAULTS.setdefault(name, getattr(fp8_kernels, name))
    DEFAULTS.setdefault("EXPERTS_W8A8T", moe_kernels.EXPERTS_W8A8T)
    DEFAULTS.setdefault("SCALES_AHEAD", fp8_kernels.SCALES_AHEAD)
    DEFAULTS.setdefault("FUSE_ADD_NORM", fp8_kernels.FUSE_ADD_NORM)
    DEFAULTS.setdefault("ADD_NORM_EARLY", fp8_kernels.ADD_NORM_EARLY)
    DEFAULTS.setdefault("EXPERTS_X_Q", moe_kernels.EXPERTS_X_Q)
    base, *off = (mode or "bf16").split("-")
    off = ({"unfused", "sumkernel", "nosplit", "nopdl"} if "s16" in off else {"nopdl"} if "s21" in off else set(off))
    pdl.ENABLED = "nopdl" not in off
    pdl.PREFETCH = "noprefetch" not in off
    pdl.EXPERTS_PLAIN = "expertsplain" in off
    fp8_kernels.FUSE_ADD_NORM = "addnorm" in off or (DEFAULTS["FUSE_ADD_NORM"] and "noaddnorm" not in off)
    fp8_kernels.ADD_NORM_EARLY = "addnormearly" in off or (DEFAULTS["ADD_NORM_EARLY"] and "noaddnormearly" not in off)
    fp8_kernels.SCALES_AHEAD = "ahead" in off or (DEFAULTS["SCALES_AHEAD"] and "noahead" not in off)
    moe_kernels.EXPERTS_W8A8T = "expertsw8a8t" in off or (DEFAULTS["EXPERTS_W8A8T"] and "noexpertsw8a8t" not in off)
    moe_kernels.EXPERTS_X_Q = "expertsxq" in off or (DEFAULTS["EXPERTS_X_Q"] and "noexpertsxq" not in off)
    if base != "bf16":
        fp8_kernels.DECODE_MODE = base
    fp8_kernels.FUSE_DECODE_QUANT = "unfused" not in off
    fp8_kernels.FUSE_ATTENTION_QUANT = ("attnquant" in off or DEFAULTS["FUSE_ATTENTION_QUANT"]) \
        and "noattnquant" not in off
    fp8_kernels.SPLITK_TICKETS = "sumkernel" not in off
    triton_kernels.MAX_SPLITS = 1 if "nosplit" in off else 16
    fp8_kernels.CUBLAS_FROM_M = 65 if "cublas" in off else DEFAULTS["CUBLAS_FROM_M"]
    fp8_kernels.VERIFY_MAX_M = 64 if "noverify" in off else DEFAULTS["VERIFY_MAX_M"]
    fp8_kernels.DECODE_TILES_29 = DEFAULTS["DECODE_TILES_29"] and "s28tiles" not in off
    fp8_kernels.SWAP_TILES = "all" if "swapall" in off else "verify" if "swapverify" in off \
        else "decode" if "swapdecode" in off else "off" if "noswap" in off else DEFAULTS["SWAP_TILES"]
    fp8_kernels.VERIFY_CUBLAS = DEFAULTS["VERIFY_CUBLAS"] and "nocublas" not in off


def agreement(outs: list[list[int]], ref: list[list[int]]) -> dict:
    """Share of identical outputs; for the others the first position where they differ."""
    same = sum(o == r for o, r in zip(outs, ref))
    first = [next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), min(len(o), len(r)))
             for o, r in zip(outs, ref) if o != r]
    return {"identical": f"{same}/{len(ref)}", "identical_share": same / len(ref), "first_divergence": first,
            "first_divergence_median": statistics.median(first) if first else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--target")
    ap.add_argument("--moe-shape")
    ap.add_argument("--work", default="/tmp/moe_shapes")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=0, help="cut prompts to this many tokens (0: whole)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--batch1-prompts", type=int, default=0, help="prompts at batch 1 (0: --prompts)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--methods", default="none", help="none and/or draft_model (the pair's draft model, bf16)")
    ap.add_argument("--k", type=int, default=4, help="draft_model's num_speculative_tokens")
    ap.add_argument("--decode-modes", default="quantize",
                    help="rows after the bf16 one, each a mode of `apply_mode` (e.g. quantize, quantize-unfused, "
                    "quantize-s16, bf16-nosplit)")
    ap.add_argument("--trace", default="", help="a Chrome trace of a few decode steps per row (torch.profiler), at this "
                    "path + _QUANT_bB.json (benchmarks/kernel_timeline.py reads it)")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = os.path.join(a.pair, "tokenizer")
    tok = AutoTokenizer.from_pretrained(tokenizer)
    target = a.target
    if a.moe_shape:
        import moe_shapes
        ns = SimpleNamespace(work=a.work, pair=a.pair, deepseek_layers=2, tiny=False)
        model, pair = moe_shapes.build(a.moe_shape, ns, tok)
        del model
        torch.cuda.empty_cache()
        target = os.path.join(pair, "target")
    texts = (heldout(a.pair) * (a.prompts // len(heldout(a.pair)) + 1))[:a.prompts]
    prompts = [tok(t)["input_ids"][:a.prompt_len or None] for t in texts]
    batches = [int(b) for b in a.batches.split(",")]
    bw = offline.copy_bandwidth()
    rows, ref = [], {}
    modes = [m for m in a.decode_modes.split(",") if m]
    methods = [m for m in a.methods.split(",") if m]
    if set(methods) - {"none", "draft_model"} or a.moe_shape and methods != ["none"]:
        ap.error("--methods: none and/or draft_model (draft_model with --target only)")
    rows_to_build = [(method, None if m is None or m.startswith("bf16") else "fp8", m)
                     for method in methods for m in [None] + modes]
    for method, quant, mode in rows_to_build:
        apply_mode(mode)
        t = time.perf_counter()
        engine, memory = build(a, target, tokenizer, quant, max(batches), method)
        build_s = time.perf_counter() - t
        for B in batches:
            use = prompts[:a.batch1_prompts] if B == 1 and a.batch1_prompts else prompts
            engine.scheduler.max_num_seqs = B
            offline.run(engine, use[:2], 4)                                   # warm-up
            runs, outs = [], None
            for _ in range(a.repeats):
                c = engine.counters
                before = (c.steps, c.spec.num_drafts, c.spec.num_draft_tokens, c.spec.num_accepted_tokens)
                done, secs = offline.run(engine, use, a.new)
                runs.append(sum(len(s.generated) for s in done.values()) / secs)
                outs = [done[i].generated for i in range(len(use))]
            # the last run's steps and drafts
            steps, drafts, drafted, accepted = (n - b for n, b in zip(
                (c.steps, c.spec.num_drafts, c.spec.num_draft_tokens, c.spec.num_accepted_tokens), before))
            row = {"label": a.label or os.path.basename(os.path.dirname(target.rstrip("/"))) or target,
                   "method": method, "quantization": quant or "bf16", "decode_mode": mode, "batch": B,
                   "tok_s": statistics.median(runs), "runs": runs,
                   "prompts": len(use), "new_tokens": a.new, "weight_bytes": memory["weight_bytes"],
                   "active_bytes": (memory.get("weights_per_token") or {}).get("active_bytes"),
                   "build_s": build_s, "graphs": engine.graphs, "steps": steps,
                   "ms_per_step": 1e3 * sum(len(o) for o in outs) / runs[-1] / max(steps, 1),
                   "acceptance_rate": accepted / drafted if drafted else None,
                   "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
            if mode is None:
                ref[method, B] = outs
            else:
                row["greedy_vs_bf16"] = agreement(outs, ref[method, B])
                row["speedup_vs_bf16"] = row["tok_s"] / next(r["tok_s"] for r in rows if r["method"] == method
                                                             and r["batch"] == B and r["decode_mode"] is None)
            if method != "none":       # the same quantization and kernels without speculation, measured before
                row["speedup_vs_none"] = row["tok_s"] / next(r["tok_s"] for r in rows if r["method"] == "none"
                                                             and r["batch"] == B and r["decode_mode"] == mode)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.trace:
                offline.profile(engine, use[:B], a.new,
                                trace=f"{a.trace}_{method}_{quant or 'bf16'}{'_' + mode if mode else ''}_b{B}.json")
        del engine
        torch.cuda.empty_cache()
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "copy_bandwidth_Bps": bw, "target": target,
            "argv": sys.argv[1:]}
    with open(a.json, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"{'method':<12}{'quant':<6}{'decode':>18}{'batch':>6}{'tok/s':>10}{'x bf16':>8}{'x none':>8}{'GB read':>9}"
          f"{'identical':>11}{'1st diff (median)':>19}{'ms/step':>9}{'accept len':>11}")
    for r in rows:
        g = r.get("greedy_vs_bf16") or {}
        vs_none = f"{r['speedup_vs_none']:.2f}" if "speedup_vs_none" in r else "-"
        print(f"{r['method']:<12}{r['quantization']:<6}{str(r['decode_mode'] or '-'):>18}{r['batch']:>6}{r['tok_s']:>10.1f}"
              f"{r.get('speedup_vs_bf16', 1.0):>8.2f}{vs_none:>8}"
              f"{(r['active_bytes'] or 0) / 1e9:>9.2f}{g.get('identical', '-'):>11}"
              f"{str(g.get('first_divergence_median', '-')):>19}{r['ms_per_step']:>9.2f}"
              f"{r['mean_acceptance_length'] or 1.0:>11.2f}")
    if bw:
        print(f"device copy bandwidth {bw / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
