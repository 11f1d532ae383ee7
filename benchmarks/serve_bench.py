"""Served against offline: `specdp serve` under `specdp bench serve` (N requests, C streams), and the same
engine config and prompts offline (`benchmarks/offline.py`, C sequences in the batch), per method.

Two workloads:
  - default: the pair's held-out prompts cut at 4 points (`workloads.cut_prompt_ids`), as offline.py's
    `--requests N` takes them; each row has served and offline tok/s and their ratio;
  - `--prefix P`: every request shares a P-token prefix (the held-out text, repeated) and has its own tail,
    served with prefix caching on and off (`--caching on,off`): TTFT and throughput with and without it.
Prompts go to the server as token ids, so both sides see the same tokens. Each side is measured `--rounds` times
(offline: one engine; served: one server) and the median reported: a 256-request run lasts about a second, and
single offline runs of one method differed by up to 40 % between machines. `--processes N` alternates N offline
processes and N servers per method and takes the median over all their rounds (on the H200 machines two processes
of one side ran up to 2x apart on the same machine).

Usage: python benchmarks/serve_bench.py --pair PAIR_DIR [--target DIR] [--methods none,draft_model,eagle]
       [--requests 256] [--concurrency 32] [--max-tokens 128] [--dp 1] [--prefix 0] [--caching on]
       [--dtype bfloat16] [--client-workers 1,2] [--rounds 3] [--processes 1]
       [--api-servers 1] [--no-offline] --work DIR --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from specdp_cli.methods import METHODS  # noqa: E402

from workloads import cut_prompt_ids, heldout  # noqa: E402


def prefix_prompts(pair: str, prefix: int, n: int) -> list[list[int]]:
    """A shared `prefix`-token prefix (the held-out prompts' text, repeated as needed), then a tail each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    texts = heldout(pair)
    ids: list[int] = tok("\n".join(texts))["input_ids"]
    while len(ids) < prefix:
        ids += ids
    return [ids[:prefix] + tok.encode(f"\n# request {i}: {texts[i % len(texts)][:60]}", add_special_tokens=False)
            for i in range(n)]


def config(a, method: str, caching: bool) -> dict:
    """The engine config offline.py builds for `method`, served."""
    spec = {"method": method, "num_speculative_tokens": a.k}
    if METHODS[method].loads:
        spec["model"] = os.path.join(a.pair, method if method.startswith("eagle") else "draft")
    return {"model": a.target or os.path.join(a.pair, "target"), "tokenizer": os.path.join(a.pair, "tokenizer"),
            "dtype": a.dtype, "max_model_len": a.max_model_len, "speculative": spec,
            "parallel": {"data_parallel_size": a.dp},
            "scheduler": {"max_num_seqs": a.concurrency, "max_num_batched_tokens": 16384},
            "cache": {"enable_prefix_caching": caching},
            "server": {"port": a.port, "model_name": "bench", "api_server_count": a.api_servers}}


def offline(a, method: str, proc: int) -> list[dict]:
    """`--rounds` offline runs (one process, one engine), each run's row; [] when the process failed."""
    out = os.path.join(a.work, f"offline_{method}_p{proc}.json")
    cmd = [sys.executable, os.path.join(HERE, "offline.py"), "--pair", a.pair, "--requests", str(a.requests),
           "--batches", ",".join([str(a.concurrency)] * a.rounds), "--methods", method, "--k", str(a.k), "--new", str(a.max_tokens),
           "--max-model-len", str(a.max_model_len), "--dtype", a.dtype, "--json", out]
    cmd += ["--target", a.target] if a.target else []
    with open(os.path.join(a.work, f"offline_{method}_p{proc}.log"), "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=log).returncode != 0:
            print(f"offline {method} failed: see {log.name}")
            return []
    return json.load(open(out))["rows"]


STEP_COUNTS = {"steps": "specdp:spec_decode_steps_by_k_total", "planned_ahead": "specdp:steps_planned_ahead_total",
               "chunk_steps": "specdp:steps_with_prompt_chunks_total", "busy_s": "specdp:rank_busy_seconds_total"}


def steps_so_far(url: str) -> dict[str, float]:
    """The server's ranks' engine steps so far (the sum of /metrics' steps per k), of them those planned ahead
    and those with prompt chunks, and the seconds they were busy (not waiting for requests)."""
    lines = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode().splitlines()
    return {key: sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))
            for key, name in STEP_COUNTS.items()}


def served(a, method: str, caching: bool, prompts_path: str, proc: int) -> dict[int, list[dict]]:
    """The bench results of one server (method, caching) for each --client-workers count: its `--rounds`
    measured rounds."""
    tag = f"{method}_{'on' if caching else 'off'}_p{proc}"
    cfg_path = os.path.join(a.work, f"serve_{tag}.yaml")
    with open(cfg_path, "w") as fh:
        yaml.safe_dump(config(a, method, caching), fh)
    log = open(os.path.join(a.work, f"server_{tag}.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "specdp_cli", "serve", cfg_path], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{a.port}"
    deadline = time.time() + 300
    try:
        while True:
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit(f"server did not come up: see {log.name}")
            time.sleep(0.5)
        bench = [sys.executable, "-m", "specdp_cli", "bench", "serve", "--base-url", url, "--dataset-path",
                 prompts_path, "--max-concurrency", str(a.concurrency), "--max-tokens", str(a.max_tokens)]
        # a warm-up round (first requests of each kind of step), then the measured ones
        subprocess.run(bench + ["--num-prompts", str(a.concurrency), "--result-filename",
                                os.path.join(a.work, f"bench_{tag}.warm.json")], check=True, stdout=subprocess.DEVNULL)
        results = {}
        for workers in a.client_workers:
            rounds = []
            for i in range(a.rounds):
                out = os.path.join(a.work, f"bench_{tag}_w{workers}_{i}.json")
                before = steps_so_far(url)
                subprocess.run(bench + ["--num-prompts", str(a.requests), "--num-workers", str(workers),
                                        "--result-filename", out], check=True, stdout=subprocess.DEVNULL)
                r = json.load(open(out))
                after = steps_so_far(url)                     # (the last step's count may arrive a step late)
                r.update({key: after[key] - before[key] for key in STEP_COUNTS})
                r.update({key: int(r[key]) for key in ("steps", "planned_ahead", "chunk_steps")})
                r["ms_per_step"] = r["duration_s"] / max(r["steps"], 1) * 1e3
                rounds.append(r)
            results[workers] = rounds
        return results
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--target")
    ap.add_argument("--methods", default="none,draft_model")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--prefix", type=int, default=0)
    ap.add_argument("--caching", default="on")
    ap.add_argument("--rounds", type=int, default=3, help="measured runs, offline and served; the median is reported")
    ap.add_argument("--processes", type=int, default=1,
                    help="offline processes and servers per method, alternating (offline, served, offline, ...); the "
                    "median is over every process's rounds: on the H200 machines two processes of one side ran up "
                    "to 2x apart on the same machine")
    ap.add_argument("--client-workers", default="1",
                    help="load-generating processes of `bench serve`, a list: each count measured on the same server")
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--api-servers", type=int, default=1, help="server.api_server_count: HTTP frontend processes")
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--label", default="")
    ap.add_argument("--work", required=True)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    a.pair = os.path.abspath(a.pair)
    a.client_workers = [int(w) for w in a.client_workers.split(",")]
    a.target = os.path.abspath(a.target) if a.target else None
    os.makedirs(a.work, exist_ok=True)
    prompts = (prefix_prompts(a.pair, a.prefix, a.requests) if a.prefix else
               cut_prompt_ids(a.pair, 4, a.requests))
    prompts_path = os.path.join(a.work, "prompts.jsonl")
    with open(prompts_path, "w") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p}) + "\n")
    rows = []
    for method in a.methods.split(","):
        cachings = [c == "on" for c in a.caching.split(",")]
        off_rows: list[dict] = []
        rounds: dict[tuple[bool, int], list[dict]] = {}
        for proc in range(a.processes):
            off_rows += [] if a.no_offline or a.prefix else offline(a, method, proc)
            for caching in cachings:
                for workers, rs in served(a, method, caching, prompts_path, proc).items():
                    rounds.setdefault((caching, workers), []).extend(rs)
        off_rows.sort(key=lambda r: r["tok_s"])
        off_row = off_rows[len(off_rows) // 2] if off_rows else None
        off = off_row["tok_s"] if off_row else None
        for (caching, workers), rs in rounds.items():
            rs.sort(key=lambda r: r["output_throughput"])
            r = rs[len(rs) // 2]
            row = {"label": a.label, "method": method, "caching": caching, "dp": a.dp, "prefix": a.prefix,
                   "api_servers": a.api_servers,
                   "client_workers": workers, "processes": a.processes,
                   "served_tok_s": r["output_throughput"], "offline_tok_s": off,
                   "served_rounds_tok_s": [x["output_throughput"] for x in rs],
                   "offline_rounds_tok_s": [x["tok_s"] for x in off_rows],
                   "served_over_offline": r["output_throughput"] / off if off else None,
                   "ttft_ms": r["ttft_ms"], "itl_ms": r["itl_ms"], "tpot_ms": r["tpot_ms"],
                   "acceptance_rate": r["acceptance_rate"], "completed": r["completed"], "failed": r["failed"],
                   "server_queue_ms": r.get("server_queue_ms"), "server_prefill_ms": r.get("server_prefill_ms"),
                   "server_ttft_ms": r.get("server_ttft_ms"), "output_tokens": r["total_output_tokens"],
                   # tokens a step and a step's time: fewer tokens a step served = emptier batches (the
                   # closed-loop clients' gaps), a longer step = more work in it or host time around it
                   "served_steps": r["steps"], "served_ms_per_step": r["ms_per_step"],
                   "offline_steps": off_row["steps"] if off_row else None,
                   "offline_ms_per_step": off_row["ms_per_step"] if off_row else None,
                   # steps planned ahead (async scheduling) and steps with prompt chunks, each side
                   "served_planned_ahead": r["planned_ahead"], "served_chunk_steps": r["chunk_steps"],
                   # the served ranks' seconds busy (not waiting for requests): a step's time without the waits
                   "served_busy_s": r["busy_s"],
                   "served_busy_ms_per_step": r["busy_s"] / a.dp / max(r["steps"], 1) * 1e3,
                   "offline_planned_ahead": off_row.get("planned_ahead") if off_row else None,
                   "offline_chunk_steps": off_row.get("chunk_steps") if off_row else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "requests": a.requests,
            "concurrency": a.concurrency, "max_tokens": a.max_tokens}
    with open(a.json, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"{'method':<12}{'caching':>8}{'clients':>8}{'served tok/s':>13}{'offline':>9}{'ratio':>7}{'TTFT p50':>9}{'TTFT p99':>9}"
          f"{'ITL p50':>8}{'ITL p99':>8}{'accept':>8}{'queue':>7}{'prefill':>8}{'srv TTFT':>9}{'steps s/o':>13}{'ms/step s/o':>13}{'busy ms/step':>13}")
    for r in rows:
        off = f"{r['offline_tok_s']:.0f}" if r["offline_tok_s"] else "-"
        ratio = f"{r['served_over_offline']:.2f}" if r["served_over_offline"] else "-"
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        print(f"{r['method']:<12}{'on' if r['caching'] else 'off':>8}{r['client_workers']:>8}{r['served_tok_s']:>13.0f}{off:>9}{ratio:>7}"
              f"{r['ttft_ms']['median']:>9.1f}{r['ttft_ms']['p99']:>9.1f}{r['itl_ms']['median']:>8.2f}"
              f"{r['itl_ms']['p99']:>8.2f}{acc:>8}{r['server_queue_ms'] or 0:>7.1f}{r['server_prefill_ms'] or 0:>8.1f}"
              f"{r['server_ttft_ms'] or 0:>9.1f}{r['served_steps']:>7}/{r['offline_steps'] or 0:<5}"
              f"{r['served_ms_per_step']:>7.2f}/{r['offline_ms_per_step'] or 0:<5.2f}{r['served_busy_ms_per_step']:>13.2f}")


if __name__ == "__main__":
    main()
