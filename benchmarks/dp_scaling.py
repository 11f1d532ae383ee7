"""DP scaling of `specdp generate`: dp sizes x dp_sync modes on one machine, the same >= 256 prompts.

Each run is the real command (accelerate-launched NCCL ranks; dp = 1 runs in-process), on the GPUs
that CUDA_VISIBLE_DEVICES names (0..dp-1). Engine tok/s excludes start-up and loading; with load is
generated tokens / wall time of the whole command. Padding share = padding steps / steps over ranks.

Usage: python benchmarks/dp_scaling.py --pair PAIR_DIR [--dps 1,2,4] [--modes never,always]
       [--cuts 4] [--new 128] [--max-num-seqs 32] --work DIR --json OUT.json
"""
import argparse
import json
import os
import subprocess
import sys
import time

import yaml


def prompts_from(pair: str, cuts: int) -> list[dict]:
    """Each held-out prompt cut at `cuts` points (1/cuts .. full), so prompt lengths vary."""
    out = []
    for line in open(os.path.join(pair, "heldout_prompts.jsonl")):
        text = json.loads(line)["prompt"]
        for c in range(1, cuts + 1):
            out.append({"prompt": text[: max(80, len(text) * c // cuts)]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--dps", default="1,2,4")
    ap.add_argument("--modes", default="never,always")
    ap.add_argument("--cuts", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--work", required=True)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    a.pair = os.path.abspath(a.pair)          # the configs written below live elsewhere
    os.makedirs(a.work, exist_ok=True)
    prompts = prompts_from(a.pair, a.cuts)
    inp = os.path.join(a.work, "prompts.jsonl")
    with open(inp, "w") as fh:
        for p in prompts:
            fh.write(json.dumps({**p, "max_tokens": a.new}) + "\n")
    rows = []
    for dp in (int(x) for x in a.dps.split(",")):
        for mode in a.modes.split(","):
            if dp == 1 and mode == "always" and "never" in a.modes:
                continue                                   # one rank: the modes are the same
            name = f"dp{dp}-{mode}"
            cfg = {"model": os.path.join(a.pair, "target"), "tokenizer": os.path.join(a.pair, "tokenizer"),
                   "dtype": "bfloat16", "device": "cuda", "max_model_len": 2048,
                   "speculative": {"method": "draft_model", "model": os.path.join(a.pair, "draft"),
                                   "num_speculative_tokens": a.k},
                   "parallel": {"data_parallel_size": dp, "dp_sync": mode},
                   "scheduler": {"max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": 16384}}
            cfg_path = os.path.join(a.work, f"{name}.yaml")
            with open(cfg_path, "w") as fh:
                yaml.safe_dump(cfg, fh)
            summary = os.path.join(a.work, f"{name}.summary.json")
            out_path = os.path.join(a.work, f"{name}.out.jsonl")
            for old in [out_path] + [os.path.join(a.work, f) for f in os.listdir(a.work)
                                     if f.startswith(f"{name}.out.jsonl.rank")]:
                os.remove(old) if os.path.exists(old) else None     # no resume from an earlier run
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(dp)))
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
            row = {"run": name, "dp": dp, "dp_sync": mode, "requests": s["requests"], "generated": s["generated_tokens"],
                   "engine_tok_s": s["tok_s"], "with_load_tok_s": s["generated_tokens"] / wall, "wall_s": wall,
                   "engine_s": s["engine_s"], "acceptance_rate": s["acceptance_rate"],
                   "padding_share": sum(x["padding_steps"] for x in s["ranks"]) / steps if steps else 0.0,
                   "ranks": s["ranks"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {r["dp_sync"]: r["engine_tok_s"] for r in rows if r["dp"] == 1}
    for r in rows:
        b = base.get("never") or base.get(r["dp_sync"])
        r["speedup_vs_dp1"] = r["engine_tok_s"] / b if b else None
    with open(a.json, "w") as fh:
        json.dump({"meta": {"date": time.strftime("%Y-%m-%d"), "prompts": len(prompts), "new_tokens": a.new,
                            "max_num_seqs_per_rank": a.max_num_seqs}, "rows": rows}, fh, indent=1)
    print(f"{'run':<14}{'engine tok/s':>14}{'x dp1':>8}{'with load':>11}{'padding':>9}")
    for r in rows:
        print(f"{r['run']:<14}{r['engine_tok_s']:>14.1f}{(r['speedup_vs_dp1'] or 0):>8.2f}"
              f"{r['with_load_tok_s']:>11.1f}{r['padding_share']:>9.2f}")


if __name__ == "__main__":
    main()
