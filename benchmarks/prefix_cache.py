"""Prefix caching: time to first token and throughput of requests sharing a long prefix (a system prompt, a
few-shot template), with caching on and off, in one process and one run (the shipped demo pair on CPU by default,
or any pair).

Two workloads, each with caching on then off (engines built alike):
  - ttft: requests one at a time (each alone in the batch), each its own tail after the shared prefix: the time
    from handing the request to the engine to its first token (median over requests 2..N: the first fills the cache);
  - batch: N such requests at once, `--max-num-seqs` in the batch: generated tokens per second.

Usage: python benchmarks/prefix_cache.py [--pair demo/pair] [--device cpu] [--prefix 400] [--requests 16]
           [--max-tokens 16] [--max-num-seqs 8] [--max-batched-tokens 2048] [--closed-loop]
           [--chunk-row-tokens N] [--hold-share F] [--async-scheduling] --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offline  # noqa: E402

from specdp_cli.runtime.engine import Engine  # noqa: E402
from specdp_cli.runtime.sampling import SamplingParams  # noqa: E402


def build(a, caching: bool) -> Engine:
    pair = os.path.abspath(a.pair)
    tok = os.path.join(pair, "tokenizer")
    return offline.engine_from({
        "model": os.path.join(pair, "target"), "max_model_len": a.prefix + 128, "device": a.device,
        **({"tokenizer": tok} if os.path.isdir(tok) else {}), "dtype": "float32" if a.device == "cpu" else "bfloat16",
        "speculative": {"method": a.method, "model": os.path.join(pair, "draft"), "num_speculative_tokens": 4},
        "scheduler": {"max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_batched_tokens,
                      **({"async_scheduling": True} if a.async_scheduling else {})},
        # on a GPU a fixed cache: the engine built before this one may still hold memory
        "cache": {"enable_prefix_caching": caching, **({"num_blocks": 8192} if a.device != "cpu" else {})}})


def prompts(engine: Engine, a) -> list[list[int]]:
    """A shared prefix of `--prefix` tokens (the demo prompts' text, repeated as needed) and a distinct tail each."""
    lines = [json.loads(x)["prompt"] for x in open(os.path.join(ROOT, "demo", "prompts.jsonl"))]
    tok = engine.output.tokenizer
    ids: list[int] = []
    for line in lines * 8:
        ids += tok.encode(line)
        if len(ids) >= a.prefix:
            break
    prefix = ids[:a.prefix]
    return [prefix + tok.encode(f"\n# request {i}: {lines[i % len(lines)][:40]}") for i in range(a.requests)]


def run(engine: Engine, batch: list[list[int]], max_tokens: int, tag: str,
        step_ms: dict | None = None, in_flight: int = 0) -> tuple[list[float], float, int, float]:
    """Serve `batch` to the end: (each request's time to first token, seconds, generated tokens, acceptance rate:
    with caching on, a sequence's drafter reads the cached blocks' drafter KV, made by the sequence that registered
    them). `step_ms`: each step's wall time goes to its "chunks" or "decode" list (whether it carried prompt chunks;
    with async scheduling a step's call also waits for the one before). `in_flight`: a closed loop of that many
    requests (a request's replacement added as it finishes, as a server's clients do) instead of all at once."""
    t0 = time.perf_counter()
    added, first = {}, {}

    def add(i: int) -> None:
        engine.add_request(engine.make_request(f"{tag}{i}", batch[i], SamplingParams(max_tokens=max_tokens), None))
        added[f"{tag}{i}"] = time.perf_counter()

    for i in range(min(in_flight, len(batch)) if in_flight else len(batch)):
        add(i)
    tokens, drafted, accepted = 0, 0, 0
    while engine.has_work:
        chunks, t = engine.counters.chunk_steps, time.perf_counter()
        outs = engine.step()
        if step_ms is not None:
            step_ms["chunks" if engine.counters.chunk_steps > chunks else "decode"].append(1e3 * (time.perf_counter() - t))
        for out in outs:
            if out.new_tokens and out.seq.req.id not in first:
                first[out.seq.req.id] = time.perf_counter()
            tokens += len(out.new_tokens)
            if out.finished and len(added) < len(batch):
                add(len(added))
            if out.finished:
                drafted += out.seq.stats.num_draft_tokens
                accepted += out.seq.stats.num_accepted_tokens
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return ([first[k] - added[k] for k in added], time.perf_counter() - t0, tokens,
            accepted / drafted if drafted else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default=os.path.join(ROOT, "demo", "pair"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--method", default="draft_model")
    ap.add_argument("--prefix", type=int, default=400)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--chunk-row-tokens", type=int,
                    help="the engine's CHUNK_ROW_TOKENS for this run (a step with prompt chunks has rows this wide)")
    ap.add_argument("--closed-loop", action="store_true",
                    help="the batch workload keeps --max-num-seqs requests in flight, each replaced as it finishes")
    ap.add_argument("--hold-share", type=float,
                    help="the engine's HOLD_SHARE for this run (async scheduling: how much of the batch may sit a step "
                         "out for the next step to be planned ahead)")
    ap.add_argument("--async-scheduling", action="store_true", help="on a CPU too (a GPU has it by default)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    if a.chunk_row_tokens:
        import specdp_cli.runtime.engine as engine_module
        engine_module.CHUNK_ROW_TOKENS = a.chunk_row_tokens
    if a.hold_share is not None:
        import specdp_cli.runtime.engine as engine_module
        engine_module.HOLD_SHARE = a.hold_share
    if a.device == "cpu":
        torch.set_num_threads(min(4, os.cpu_count() or 1))
    rows = {}
    for caching in (True, False):
        engine = build(a, caching)
        batch = prompts(engine, a)
        run(engine, batch[:1], 2, "warm")                 # first calls, allocator; fills the cache with the prefix
        ttft = [run(engine, [p], a.max_tokens, f"t{i}-")[0][0] for i, p in enumerate(batch)]
        steps = {"chunks": [], "decode": []}
        ahead = engine.counters.planned_ahead
        _, secs, tokens, acceptance = run(engine, batch, a.max_tokens, "b", steps, a.max_num_seqs if a.closed_loop else 0)
        rows["on" if caching else "off"] = {
            "ttft_median_s": statistics.median(ttft[1:]), "ttft_first_s": ttft[0], "batch_s": secs,
            "batch_tok_s": tokens / secs, "acceptance": acceptance, "hits": engine.pool.hits, "queries": engine.pool.queries,
            "prompt_tokens": len(batch[0]), "steps": {k: len(v) for k, v in steps.items()},
            "planned_ahead": engine.counters.planned_ahead - ahead,
            "step_ms_median": {k: statistics.median(v) if v else None for k, v in steps.items()}}
        del engine
        if a.device != "cpu":
            torch.cuda.empty_cache()
    on, off = rows["on"], rows["off"]
    print(f"{'caching':<8} {'TTFT median ms':>15} {'batch tok/s':>12} {'hit rate':>9} {'acceptance':>11} "
          f"{'steps chunk/decode':>19} {'ms/step chunk/decode':>21} {'planned ahead':>14}")
    for k, r in rows.items():
        ms = r["step_ms_median"]
        print(f"{k:<8} {r['ttft_median_s'] * 1e3:>15.1f} {r['batch_tok_s']:>12.1f} "
              f"{r['hits'] / r['queries'] if r['queries'] else 0:>9.1%} {r['acceptance']:>11.1%} "
              f"{r['steps']['chunks']:>9}/{r['steps']['decode']:<9} {ms['chunks'] or 0:>10.3f}/{ms['decode'] or 0:<10.3f} {r['planned_ahead']:>14}")
    ratio = {"ttft_on_over_off": on["ttft_median_s"] / off["ttft_median_s"],
             "batch_throughput_on_over_off": on["batch_tok_s"] / off["batch_tok_s"]}
    print(f"TTFT on/off {ratio['ttft_on_over_off']:.2f}x, throughput on/off {ratio['batch_throughput_on_over_off']:.2f}x")
    with open(a.json, "w") as fh:
        json.dump({"args": vars(a), "rows": rows, **ratio}, fh, indent=1)


if __name__ == "__main__":
    main()
