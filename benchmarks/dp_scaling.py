"""DP scaling and start-up of `specdp generate`: runs of dp size x dp_sync on one machine, the same
prompts (held-out prompts cut at varied lengths).

Each run is the real command (accelerate-launched NCCL ranks; dp = 1 runs in-process), on the GPUs
that CUDA_VISIBLE_DEVICES names (0..dp-1). Engine tok/s excludes start-up and loading; with load is
generated tokens / wall time of the whole command; start-up = the command's wall time minus engine
time (the summary's `startup` phases say where it went). A run listed twice runs twice (the first
run of a session pays cold compile caches). Padding share = padding steps / steps over ranks. An engine
phase of 256x128 lasts under a second, so single runs are noisy: list a configuration several times and
read the medians printed at the end ("x dp1" there is against the median of the dp 1 runs).

A run's mode is a dp_sync value, or `ep`: lockstep with the routed experts split over the ranks
(`enable_expert_parallel`; a mixture-of-experts target). A third field `adaptive` (`2:always:adaptive`)
runs `speculative.adaptive: true` with num_speculative_tokens = --adaptive-k-max instead of the fixed --k.

Usage: python benchmarks/dp_scaling.py --pair PAIR_DIR [--runs 1:never,1:never,2:never,2:always,2:ep]
       [--requests 256] [--cuts 4] [--new 128] [--max-num-seqs 32] [--method draft_model] [--adaptive-k-max 6] --work DIR --json OUT.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specdp_cli.methods import METHODS  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import cut_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--runs", default="1:never,1:never,2:never,2:always")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--method", default="draft_model")
    ap.add_argument("--cuts", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--adaptive-k-max", type=int, default=6)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (float32, gloo)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    a.pair = os.path.abspath(a.pair)          # the configs written below live elsewhere
    os.makedirs(a.work, exist_ok=True)
    prompts = cut_prompts(a.pair, a.cuts, a.requests)
    inp = os.path.join(a.work, "prompts.jsonl")
    with open(inp, "w") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p, "max_tokens": a.new}) + "\n")
    rows = []
    seen: dict[str, int] = {}
    for item in a.runs.split(","):
        fields = item.split(":")
        dp, mode, adaptive = int(fields[0]), fields[1], fields[2:] == ["adaptive"]
        if fields[2:] not in ([], ["adaptive"]):
            ap.error(f"--runs: {item!r}: the third field can only be `adaptive`")
        name = f"dp{dp}-{mode}" + ("-adaptive" if adaptive else "")
        seen[name] = seen.get(name, 0) + 1
        cfg = {"model": os.path.join(a.pair, "target"), "tokenizer": os.path.join(a.pair, "tokenizer"),
               "dtype": "bfloat16" if a.device == "cuda" else "float32", "device": a.device, "max_model_len": 2048,
               "speculative": {"method": a.method,
                               **({"num_speculative_tokens": a.adaptive_k_max, "adaptive": True} if adaptive
                                  else {"num_speculative_tokens": a.k}),
                               **({"model": os.path.join(a.pair, "draft")} if METHODS[a.method].loads else {})},
               "parallel": ({"data_parallel_size": dp, "dp_sync": "always", "enable_expert_parallel": True}
                            if mode == "ep" else {"data_parallel_size": dp, "dp_sync": mode}),
               "scheduler": {"max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": 16384}}
        cfg_path = os.path.join(a.work, f"{name}.yaml")
        with open(cfg_path, "w") as fh:
            yaml.safe_dump(cfg, fh)
        summary = os.path.join(a.work, f"{name}.summary.json")
        out_path = os.path.join(a.work, f"{name}.out.jsonl")
        for old in [out_path] + [os.path.join(a.work, f) for f in os.listdir(a.work)
                                 if f.startswith(f"{name}.out.jsonl.rank")]:
            os.remove(old) if os.path.exists(old) else None     # no resume from an earlier run
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(dp))) if a.device == "cuda" \
            else dict(os.environ)
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "specdp_cli", "generate", cfg_path, "--input", inp,
                            "--output", out_path, "--summary-json", summary],
                           env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if r.returncode != 0:
            print(json.dumps({"run": name, "error": r.stderr[-2000:]}), flush=True)
            continue
        s = json.load(open(summary))
        steps = sum(x["steps"] for x in s["ranks"])
        row = {"run": name, "attempt": seen[name], "dp": dp, "dp_sync": mode, "method": a.method,
               "adaptive": adaptive, "requests": s["requests"],
               "generated": s["generated_tokens"], "engine_tok_s": s["tok_s"],
               "with_load_tok_s": s["generated_tokens"] / wall, "wall_s": wall, "engine_s": s["engine_s"],
               "startup_s": wall - s["engine_s"], "startup": s["startup"], "launch_phases": s["launch_phases"],
               # after the engine: waiting for the other ranks, writing the output, the processes' exit
               "after_engine_s": wall - s["engine_s"] - sum(s["startup"].values()),
               "acceptance_rate": s["acceptance_rate"],
               "padding_share": sum(x["padding_steps"] for x in s["ranks"]) / steps if steps else 0.0,
               "ranks": s["ranks"],
               "steps_by_k": (s.get("speculation") or {}).get("steps_by_k"),
               # rank 0's adaptive model and what it measured (adaptive runs)
               "spec_model": {x: (s.get("speculation") or {}).get(x) for x in
                              ("model_rows", "model", "model_acceptance_per_position", "model_chunk_share", "model_chunk_extra_ms",
                                       "model_level", "trace")}
               if adaptive else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = max((r["engine_tok_s"] for r in rows if r["dp"] == 1), default=None)
    for r in rows:
        r["speedup_vs_dp1"] = r["engine_tok_s"] / base if base else None
    with open(a.json, "w") as fh:
        json.dump({"meta": {"date": time.strftime("%Y-%m-%d"), "method": a.method, "k": a.k,
                            "prompts": len(prompts), "new_tokens": a.new,
                            "max_num_seqs_per_rank": a.max_num_seqs}, "rows": rows}, fh, indent=1)
    print(f"{'run':<20}{'#':>2}{'engine tok/s':>14}{'x dp1':>8}{'with load':>11}{'start-up s':>11}{'padding':>9}")
    for r in rows:
        print(f"{r['run']:<20}{r['attempt']:>2}{r['engine_tok_s']:>14.1f}{(r['speedup_vs_dp1'] or 0):>8.2f}"
              f"{r['with_load_tok_s']:>11.1f}{r['startup_s']:>11.2f}{r['padding_share']:>9.2f}")
    print(f"{'per rank:':<22} requests / steps / engine s (a fixed split ends with the slowest rank; the pool of")
    print(f"{'':<22} dp_sync never lets faster ranks serve more)")
    for r in rows:
        print(f"{r['run']:<20}{r['attempt']:>2} " + "   ".join(
            f"{x['requests']}/{x['steps']}/{x.get('engine_s') or 0:.3f}" for x in r["ranks"]))
    print(f"{'start-up, s:':<22} " + " ".join(f"{p:>8}" for p in ("cli", "spawn", "imports", "job wait", "join", "load", "kv",
                                                          "capture", "after")))
    for r in rows:
        ph = [*r["launch_phases"].values(), *list(r["startup"].values())[1:], r["after_engine_s"]]
        print(f"{r['run']:<20}{r['attempt']:>2} " + " ".join(f"{v:>8.2f}" for v in ph))
    medians = {name: {k: statistics.median(r[k] for r in rows if r["run"] == name)
                      for k in ("engine_tok_s", "startup_s")} for name in dict.fromkeys(r["run"] for r in rows)}
    dp1 = [m["engine_tok_s"] for name, m in medians.items() if name.startswith("dp1-")]
    print(f"{'medians:':<21}{'runs':>5}{'engine tok/s':>14}{'x dp1':>8}{'start-up s':>12}")
    for name, m in medians.items():
        n = sum(1 for r in rows if r["run"] == name)
        print(f"{name:<21}{n:>5}{m['engine_tok_s']:>14.1f}{m['engine_tok_s'] / dp1[0] if dp1 else 0:>8.2f}"
              f"{m['startup_s']:>12.2f}")
    with open(a.json) as fh:
        doc = json.load(fh)
    doc["medians"] = medians
    with open(a.json, "w") as fh:
        json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
