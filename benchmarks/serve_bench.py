"""`specdp serve` (dp = 2 by default) under `specdp bench serve` at several concurrencies.

Usage: python benchmarks/serve_bench.py --pair PAIR_DIR [--dp 2] [--concurrency 1,8,32] [--max-tokens 128]
       --work DIR --json OUT.json
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import yaml


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--work", required=True)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    a.pair = os.path.abspath(a.pair)          # the configs written below live elsewhere
    os.makedirs(a.work, exist_ok=True)
    cfg = {"model": os.path.join(a.pair, "target"), "tokenizer": os.path.join(a.pair, "tokenizer"),
           "dtype": "bfloat16", "max_model_len": 2048,
           "speculative": {"method": "draft_model", "model": os.path.join(a.pair, "draft"), "num_speculative_tokens": 4},
           "parallel": {"data_parallel_size": a.dp}, "scheduler": {"max_num_seqs": 64},
           "server": {"port": a.port, "model_name": "codepair"}}
    cfg_path = os.path.join(a.work, "serve.yaml")
    with open(cfg_path, "w") as fh:
        yaml.safe_dump(cfg, fh)
    log = open(os.path.join(a.work, "server.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "specdp_cli", "serve", cfg_path], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{a.port}"
    deadline = time.time() + 300
    while True:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        if server.poll() is not None or time.time() > deadline:
            sys.exit(f"server did not come up: see {log.name}")
        time.sleep(0.5)
    results = []
    for c in (int(x) for x in a.concurrency.split(",")):
        out = os.path.join(a.work, f"bench_c{c}.json")
        subprocess.run([sys.executable, "-m", "specdp_cli", "bench", "serve", "--base-url", url, "--dataset-path",
                        os.path.join(a.pair, "heldout_prompts.jsonl"), "--max-concurrency", str(c),
                        "--num-prompts", str(max(16, 4 * c)), "--max-tokens", str(a.max_tokens),
                        "--result-filename", out],
                       check=True)
        results.append(json.load(open(out)))
    server.send_signal(signal.SIGTERM)
    rc = server.wait(60)
    with open(a.json, "w") as fh:
        json.dump({"meta": {"date": time.strftime("%Y-%m-%d"), "dp": a.dp, "server_exit": rc}, "rows": results}, fh, indent=1)
    print(f"{'conc':>5}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}{'ITL p50':>9}{'accept':>8}")
    for r in results:
        print(f"{r['max_concurrency']:>5}{r['request_throughput']:>8.2f}{r['output_throughput']:>11.1f}"
              f"{r['ttft_ms']['median']:>10.1f}{r['tpot_ms']['median']:>10.2f}{r['itl_ms']['median']:>9.2f}"
              f"{(r['acceptance_rate'] or 0):>8.3f}")
    print(f"server exit status after SIGTERM: {rc}")


if __name__ == "__main__":
    main()
