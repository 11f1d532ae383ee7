"""The serving rank's loop's own cost a step (`server/rank.py`: reading the links, the step's events, the rank's
state, pickling and sending), around a stand-in engine whose step costs almost nothing: STREAMS running requests,
each given TOKENS tokens a step, for STEPS measured steps. The rank runs in its own process (a CPU of its own),
this one (another CPU) drains its messages as a frontend would.

`--root DIR` imports specdp_cli from DIR instead (e.g. `git archive COMMIT specdp_cli | tar -x -C DIR`): before and
after on the same machine.

Usage: python benchmarks/rank_loop.py [--streams 32] [--tokens 3] [--steps 20000] [--runs 3] [--root DIR]
           [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Listener
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM_UP = 500


class StandInEngine:
    """What serve_rank needs of an engine; each step returns every running request `tokens` tokens, and the time of
    the measured steps goes to `q` (the stand-in's own part: building its outputs)."""

    step_in_flight = True            # as with async scheduling: the tokens go out as soon as the step returns

    def __init__(self, q, tokens: int, steps: int):
        from specdp_cli.runtime.engine import RankCounters

        self.q, self.tokens, self.steps = q, list(range(7, 7 + tokens)), steps
        self.running, self.waiting = [], []
        self.scheduler = SimpleNamespace(running=self.running, waiting=self.waiting)
        self.pool = SimpleNamespace(num_free=1, num_blocks=1, queries=0, hits=0)
        self.counters = RankCounters()
        self.spec_len = SimpleNamespace(used={tokens - 1: 0})      # steps per k (/metrics)
        self.step_no, self.t0 = 0, None

    def stop_followers(self):
        pass

    def make_request(self, rid, prompt_ids, params, seed):
        return SimpleNamespace(id=rid)

    def add_request(self, req) -> None:
        self.running.append(SimpleNamespace(req=req, finish_reason=None))

    def abort(self, rid) -> bool:
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def step(self, received: int = 0, while_device_runs=None):
        self.step_no += 1
        if while_device_runs is not None:
            while_device_runs()
        if self.step_no == WARM_UP:
            self.t0 = time.perf_counter()
        if self.step_no == WARM_UP + self.steps:
            self.q.put((time.perf_counter() - self.t0) / self.steps)
            self.running.clear()
            return []
        self.spec_len.used[len(self.tokens) - 1] += 1
        return [SimpleNamespace(seq=s, new_tokens=self.tokens, finished=False, logprobs=None) for s in self.running]


def rank(root: str, spec: dict, q, tokens: int, steps: int, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    sys.path.insert(0, root)
    from specdp_cli.server.rank import serve_rank

    dp = SimpleNamespace(lockstep=False, rank=0, publish=lambda *a: None)
    serve_rank(StandInEngine(q, tokens, steps), dp, {"links": [spec]})


def one_run(a, cpus: list[int]) -> float:
    """µs a step of one run."""
    spec = {"host": "127.0.0.1", "port": 0, "authkey": os.urandom(16).hex()}
    listener = Listener(("127.0.0.1", 0), authkey=bytes.fromhex(spec["authkey"]))
    spec["port"] = listener.address[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=rank, args=(a.root, spec, q, a.tokens, a.steps, cpus[1] if len(cpus) > 1 else None),
                    daemon=True)
    p.start()
    conn = listener.accept()
    conn.recv()                                   # hello
    params = {"max_tokens": 10**9, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
    for i in range(a.streams):
        conn.send(("add", f"cmpl-{i:024x}", [1, 2, 3], params, None))
    while q.empty():
        if conn.poll(0.01):
            conn.recv_bytes()
    us = q.get() * 1e6
    conn.send(("shutdown",))
    while True:                                   # to the rank's goodbye
        try:
            conn.recv_bytes()
        except EOFError:
            break
        if not p.is_alive():
            break
    p.join(30)
    listener.close()
    return us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--root", default=ROOT)
    ap.add_argument("--json")
    a = ap.parse_args()
    a.root = os.path.abspath(a.root)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[0]})         # this process on one CPU, the rank on another
    runs = [one_run(a, cpus) for _ in range(a.runs)]
    print(f"{'root':<40}{'streams':>8}{'tokens':>7}{'us a step (median)':>20}  runs")
    print(f"{a.root[-40:]:<40}{a.streams:>8}{a.tokens:>7}{statistics.median(runs):>20.1f}  "
          + " ".join(f"{x:.1f}" for x in runs))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"root": a.root, "streams": a.streams, "tokens": a.tokens, "steps": a.steps,
                       "us_per_step_runs": runs, "us_per_step": statistics.median(runs)}, fh, indent=1)


if __name__ == "__main__":
    main()
