"""Where one decode step's time goes, on one device: host vs device, and the kernels of each forward.

For each method at batch 1 (or --batch): the wall ms per step of a run, the device ms of the step's
whole-step CUDA graph replayed alone (so wall − device is the host's share), the device ms of each
forward's own graph (target at T = k + 1, drafter at T = 1), and an eager profile of a few steps:
CUDA kernels per step and the kernels that take the most time. Writes JSON with --json.

Usage: python benchmarks/step_probe.py --pair PAIR_DIR [--methods none,draft_model] [--k 4] [--batch 1]
           [--json OUT.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline import build, heldout, run, sync  # noqa: E402
from specdp_cli.runtime.sampling import SamplingParams  # noqa: E402


def replay_ms(graph, n: int = 200) -> float:
    for _ in range(10):
        graph.replay()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        graph.replay()
    sync()
    return (time.perf_counter() - t) / n * 1e3


def host_split(engine, prompts, new: int) -> dict:
    """ms per step inside the engine's phases (host timers; `to_host` includes waiting for the device)."""
    spent: dict[str, float] = {}

    def timed(obj, name, label):
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
        setattr(obj, name, wrapper)

    timed(engine.drafter, "host_drafts", "host_drafts")
    timed(engine, "_rows", "rows")
    timed(engine.dp, "sync_step", "sync_step")
    timed(engine.inputs, "stage", "stage")
    timed(engine, "_run_device_step", "device_launch")
    timed(engine, "_device_step", "device_step_eager")
    timed(engine, "_read", "to_host_wait")
    timed(engine, "_accept", "accept")
    timed(engine.drafter, "after_step", "after_step")
    c0 = engine.counters.steps
    _, s = run(engine, prompts, new)
    steps = engine.counters.steps - c0
    return {"wall_ms": s / steps * 1e3, **{k: v / steps * 1e3 for k, v in spent.items()}}


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def eager_kernels(a, method: str, prompts, steps: int = 20) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine = build(a, method, True, a.batch)
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(f"p{i}", p, SamplingParams(max_tokens=a.new), None))
    for _ in range(4):
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    per_step = sum(e.count for e in kernels) / steps
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
    return {"kernels_per_step": per_step,
            "device_us_per_step": sum(e.self_device_time_total for e in kernels) / steps,
            "top": [(e.key[:70], e.count / steps, e.self_device_time_total / steps) for e in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--target")
    ap.add_argument("--methods", default="none,draft_model")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--no-eager-profile", action="store_true", help="skip the eager profile (a second engine)")
    ap.add_argument("--json")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(a.pair, "tokenizer"))
    prompts = [tok(t)["input_ids"] for t in heldout(a.pair)[: max(8, a.batch)]]
    out = []
    for method in a.methods.split(","):
        engine = build(a, method, False, a.batch)
        run(engine, prompts[: a.batch], 16)                       # warm-up
        c0 = engine.counters.steps
        _, s = run(engine, prompts, a.new)
        steps = engine.counters.steps - c0
        k = a.k if method != "none" else 0
        W = k + 1 if method != "none" else 1
        whole = [g for key, (g, _) in engine.step_graphs.items() if key[0] == a.batch and key[2] == W and key[3] == W]
        row = {"method": method, "k": k, "batch": a.batch, "wall_ms_per_step": s / steps * 1e3,
               "tokens_per_step": a.new * len(prompts) / steps,
               "step_graph_ms": replay_ms(whole[0]) if whole else None,
               "target_graph_ms": None}
        if torch.cuda.is_available():
            row["target_graph_ms"] = replay_ms(engine.target.graphs[(a.batch, W)])
            if engine.drafter.has_forward:
                for T in (1, 2):
                    g = engine.drafter.runner.graphs.get((a.batch, T))
                    row[f"drafter_graph_ms_T{T}"] = replay_ms(g) if g is not None else None
        row["host_ms_per_step"] = host_split(engine, prompts[: max(a.batch, 4)], a.new)
        print(json.dumps(row), flush=True)
        del engine, whole
        release_memory()
        if torch.cuda.is_available() and not a.no_eager_profile:
            row.update(eager_kernels(a, method, prompts[: a.batch]))
            release_memory()
            print(json.dumps({k: row[k] for k in ("method", "kernels_per_step", "device_us_per_step", "top")}), flush=True)
        out.append(row)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
