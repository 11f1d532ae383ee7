"""Offline throughput of the specdp engine: methods x batch sizes, in one process on one device.

A row's tok/s is generated tokens / wall time of the run (start-up and a warm-up excluded), greedy,
the same prompts in every row. "greedy equal" counts outputs identical to the `none` method's
(target-only decoding through the same engine); with --eager every row also runs with
`enforce_eager: true` and "graphs = eager" counts identical outputs. --profile METHOD:BATCH prints
torch.profiler's tables (self CUDA and self CPU time) for a few steps of that row.

Usage:
  python benchmarks/offline.py --pair PAIR_DIR [--target DIR] [--prompts 32] [--requests N --cuts 4]
      [--new 128] [--batches 1,8,32] [--methods none,ngram,draft_model] [--k 4] [--dtype bfloat16]
      [--max-model-len 2048] [--eager] [--profile draft_model:1] [--repeats 3] --json OUT.json
PAIR_DIR holds target/, draft/, tokenizer/, heldout_prompts.jsonl and, for --methods eagle / eagle3, eagle/
(an EAGLE-1 head) / eagle3/ (an EAGLE-3 head, `benchmarks/train_eagle3.py`): the codepair layout; --target
replaces the target (e.g. the widened 8B-sized one). --requests N takes N prompts from the held-out
set cut at --cuts points (varied lengths) instead of the first --prompts held-out prompts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from specdp_cli.config import validate  # noqa: E402
from specdp_cli.launch import threads_per_rank  # noqa: E402
from specdp_cli.methods import METHODS  # noqa: E402
from specdp_cli.plan import async_method  # noqa: E402
from specdp_cli.preflight import run_preflight  # noqa: E402
from specdp_cli.runtime.dist import DPGroup  # noqa: E402
from specdp_cli.runtime.engine import Engine, RankCounters  # noqa: E402
from specdp_cli.runtime.heap import collections_since_startup, freeze_startup_heap  # noqa: E402
from specdp_cli.runtime.sampling import SamplingParams  # noqa: E402
from workloads import cut_prompts, heldout  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth() -> float | None:
    """Device copy bandwidth in bytes/s (bytes read + written), the weight-read ceiling's divisor."""
    if not torch.cuda.is_available():
        return None
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


def engine_from(data: dict) -> Engine:
    """An engine of one rank over a config (a dict as a YAML config holds it), checked by preflight first."""
    cfg = validate(data)
    report = run_preflight(cfg)
    assert report.ok, report.errors
    dev = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    if cfg.device == "cuda":          # the intra-op threads a launched rank of one GPU has (launch.threads_per_rank)
        torch.set_num_threads(threads_per_rank("cuda", 1))
    return Engine(cfg, report.plan, DPGroup.solo(), dev)


def run(engine: Engine, prompts: list[list[int]], new: int, fields: dict | None = None) -> tuple[dict, float]:
    """Serve `prompts` to the end (`new` tokens each; `fields`: further sampling fields, as check_sampling
    returns them): ({index: Sequence}, seconds)."""
    for i, p in enumerate(prompts):
        params = SamplingParams.from_dict({**(fields or {}), "max_tokens": new})
        engine.add_request(engine.make_request(i, p, params, None))
    # the whole job is handed over at once: once nothing waits, the batch drains as `generate`'s does when its
    # input is used up (an adaptive k then plans for the job's tail; a fixed k ignores this)
    engine.drain_to_finish = True
    done = {}
    sync()
    t = time.perf_counter()
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                done[out.seq.req.id] = out.seq
    sync()
    return done, time.perf_counter() - t


def build(a, method: str, eager: bool, max_seqs: int) -> Engine:
    engine = engine_from({
        "model": a.target or os.path.join(a.pair, "target"), "tokenizer": os.path.join(a.pair, "tokenizer"),
        "dtype": a.dtype, "device": "cuda" if torch.cuda.is_available() else "cpu", "max_model_len": a.max_model_len,
        "enforce_eager": eager,
        "speculative": {"method": method, "num_speculative_tokens": a.k,
                        **({"model": os.path.join(a.pair, method if method.startswith("eagle") else "draft")}
                           if METHODS[method].loads else {})},
        "scheduler": {"max_num_seqs": max_seqs, "max_num_batched_tokens": a.max_batched_tokens,
                      "async_scheduling": async_setting(getattr(a, "async_scheduling", "auto"), method)},
        **({"cache": {"gpu_memory_utilization": a.gpu_memory_utilization}}
           if getattr(a, "gpu_memory_utilization", None) else {})})
    freeze_startup_heap()                  # as the CLI's ranks do
    return engine


def profile(engine: Engine, prompts, new: int, steps: int = 30, trace: str | None = None) -> None:
    """A few decode steps under torch.profiler: the kernel tables, and with `trace` a Chrome trace (every
    kernel of the steps in order: benchmarks/kernel_timeline.py reads it)."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(f"p{i}", p, SamplingParams(max_tokens=new), None))
    for _ in range(5):                      # past prefill
        engine.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    t = time.perf_counter()
    with tprofile(activities=acts) as prof:
        for _ in range(steps):
            if engine.has_work:
                engine.step()
        sync()
    print(f"profile: {(time.perf_counter() - t) / steps * 1e3:.3f} ms per step (profiler on)")
    if trace:
        prof.export_chrome_trace(trace)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    while engine.has_work:
        engine.step()


def rounds_on_stdin(engine: Engine, prompts, new: int) -> None:
    """A run of every prompt for each line read on stdin, its figures a JSON line on stdout, until stdin closes
    (`serve_bench.py --interleave`: offline runs between served rounds, on the same machine at the same time)."""
    print("ready", flush=True)
    for _ in sys.stdin:
        engine.counters = c = RankCounters()
        t0, gc0 = time.time(), collections_since_startup()
        done, secs = run(engine, prompts, new)
        gen, gc1 = sum(len(s.generated) for s in done.values()), collections_since_startup()
        print(json.dumps({"tok_s": gen / secs, "s": secs, "t0": t0, "tokens": gen, "steps": c.steps,
                          "ms_per_step": secs / max(c.steps, 1) * 1e3, "planned_ahead": c.planned_ahead,
                          "chunk_steps": c.chunk_steps, "gc_collections": gc1["gc_collections"] - gc0["gc_collections"],
                          "gc_pause_s": gc1["gc_pause_s"] - gc0["gc_pause_s"]}), flush=True)


def async_setting(mode: str, method: str):
    """--async-scheduling for one method: None (the default), True where the method runs it, or False."""
    return {"auto": None, "on": True if async_method(method) else None, "off": False}[mode]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--target")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--requests", type=int, default=0)
    ap.add_argument("--cuts", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--methods", default="none,ngram,draft_model")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--profile", default="")
    ap.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                    help="scheduler.async_scheduling of every method that runs it (auto: the default, on a GPU for all "
                         "but ngram; on: asked for; off: synchronous steps)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each row; its figures are the median run's")
    ap.add_argument("--stdin-rounds", action="store_true",
                    help="the first method at the first batch size: a run for each line read on stdin, its figures "
                         "a JSON line on stdout (serve_bench.py --interleave)")
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="cache.gpu_memory_utilization (engines sharing a GPU: each sizes its KV cache from its share)")
    ap.add_argument("--label", default="codepair")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(a.pair, "tokenizer"))
    texts = cut_prompts(a.pair, a.cuts, a.requests) if a.requests else heldout(a.pair)[: a.prompts]
    prompts = [tok(t)["input_ids"] for t in texts]
    batches = [int(b) for b in a.batches.split(",")]
    bw = copy_bandwidth()
    rows, reference = [], None
    for method in a.methods.split(","):
        outs_by_mode = {}
        for eager in ([False, True] if a.eager else [False]):
            t_build = time.perf_counter()
            engine = build(a, method, eager, max(batches))
            build_s = time.perf_counter() - t_build
            for B in batches:
                engine.scheduler.max_num_seqs = B          # the batch size: at most B sequences run at once
                run(engine, prompts[:2], 8)                # warm-up
                runs = []
                print(f"# measuring {method} at batch {B}: {a.repeats} run(s)", flush=True)   # (a profiler waits for it)
                if a.stdin_rounds:
                    rounds_on_stdin(engine, prompts, a.new)
                    return
                for _ in range(a.repeats):
                    engine.counters = RankCounters()
                    t0 = time.time()
                    done, secs = run(engine, prompts, a.new)
                    runs.append((secs, done, engine.counters, t0))
                secs, done, c, _ = sorted(runs, key=lambda r: r[0])[len(runs) // 2]     # the median run
                outs = [done[i].generated for i in range(len(prompts))]
                outs_by_mode[(eager, B)] = outs
                if method == "none" and not eager and reference is None:
                    reference = outs
                gen = sum(len(o) for o in outs)
                s = c.spec
                row = {"label": a.label, "method": method, "batch": B, "eager": eager, "k": a.k if method != "none" else 0,
                       "requests": len(prompts), "tok_s": gen / secs, "tok_s_runs": [gen / r[0] for r in runs],
                       "runs_t0": [r[3] for r in runs], "runs_s": [r[0] for r in runs],
                       "tokens": gen, "s": secs, "steps": c.steps,
                       "ms_per_step": secs / max(c.steps, 1) * 1e3, "preemptions": c.preemptions, "planned_ahead": c.planned_ahead,
                       "chunk_steps": c.chunk_steps,
                       "build_s": build_s, "startup": engine.startup, "graphs": engine.graphs,
                       "kv_blocks": engine.pool.num_blocks,
                       "acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else None,
                       "mean_acceptance_length": 1 + s.num_accepted_tokens / s.num_drafts if s.num_drafts else None,
                       "greedy_equal_vs_none": (f"{sum(o == r for o, r in zip(outs, reference))}/{len(outs)}"
                                                if reference else None)}
                if eager:
                    g = outs_by_mode.get((False, B))
                    row["graphs_equal_eager"] = f"{sum(x == y for x, y in zip(g, outs))}/{len(outs)}" if g else None
                rows.append(row)
                print(json.dumps(row), flush=True)
                if a.profile == f"{method}:{B}" and not eager:
                    profile(engine, prompts[:B], a.new)
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "requests": len(prompts), "new_tokens": a.new, "dtype": a.dtype, "copy_bandwidth_Bps": bw,
            "target": a.target or os.path.join(a.pair, "target"), "argv": sys.argv[1:]}
    with open(a.json, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"{'method':<12}{'batch':>6}{'eager':>6}{'tok/s':>10}{'ms/step':>9}{'accept':>8}{'mean len':>9}{'=none':>7}{'=eager':>7}")
    for r in rows:
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        ml = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "-"
        print(f"{r['method']:<12}{r['batch']:>6}{'y' if r['eager'] else '':>6}{r['tok_s']:>10.1f}{r['ms_per_step']:>9.3f}"
              f"{acc:>8}{ml:>9}{str(r['greedy_equal_vs_none']):>7}{str(r.get('graphs_equal_eager', '')):>7}")
    if bw:
        print(f"device copy bandwidth {bw / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
