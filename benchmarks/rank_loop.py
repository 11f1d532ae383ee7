"""The serving rank's loop's own cost a step (`server/rank.py`: reading the links, the step's events, the rank's
state, encoding and sending), around frontend_bench.py's stand-in engine with a step that costs nothing: STREAMS
running requests, each given TOKENS tokens a step, for SECONDS. The rank runs in its own process (a CPU of its own);
this one (another CPU) drains its messages as a frontend would, with no HTTP.

`--root DIR` imports specdp_cli from DIR instead (e.g. `git archive COMMIT specdp_cli | tar -x -C DIR`): before and
after on the same machine. `--link tcp,unix`: the link over loopback TCP and over a Unix socket (as `specdp serve`
links ranks on its machine since session 41), run by run in turn. `--max-tokens N`: requests end after N tokens
and this process sends a new one for each that ended (a closed loop of STREAMS clients, as a served benchmark's), so
the loop also takes requests in and sends their ends (by default they never end); `--prompt`: a request's prompt
tokens.

Usage: python benchmarks/rank_loop.py [--streams 32] [--tokens 3] [--max-tokens 0] [--prompt 3] [--seconds 3]
           [--runs 3] [--root DIR] [--link tcp,unix] [--profile OUT.prof] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Listener

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import frontend_bench  # noqa: E402


def rank(root: str, *args) -> None:
    sys.path.insert(0, root)            # ahead of frontend_bench's: the package measured
    frontend_bench.rank_main(*args)


def link_codec(root: str):
    """(send, receive) of the measured package's link (its server/link.py, loaded alone: it imports only the
    standard library); pickle's through the connection where it has none (before session 33)."""
    path = os.path.join(root, "specdp_cli", "server", "link.py")
    spec = importlib.util.spec_from_file_location("measured_link", path)
    link = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(link)
    if hasattr(link, "recv_message"):
        return link.send_message, link.recv_message
    return (lambda conn, msg: conn.send(msg)), (lambda conn: conn.recv())


def one_run(a, cpus: list[int], kind: str = "tcp") -> float:
    """µs a step of one run, the link over `kind` (tcp, unix)."""
    send_message, recv_message = link_codec(a.root)
    key = os.urandom(16).hex()
    if kind == "unix":
        path = os.path.join(tempfile.mkdtemp(prefix="rank-loop-"), "link")
        spec = {"unix": True, "path": path, "authkey": key}
        listener = Listener(path, "AF_UNIX", authkey=bytes.fromhex(key))
    else:
        spec = {"host": "127.0.0.1", "port": 0, "authkey": key}
        listener = Listener(("127.0.0.1", 0), authkey=bytes.fromhex(key))
        spec["port"] = listener.address[1]
    # a request's message: with the prompt's block hashes from session 40 on (empty: no prefix caching here)
    with open(os.path.join(a.root, "specdp_cli", "server", "rank.py")) as fh:
        hashes = (b"",) if "hashes = msg" in fh.read() else ()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    cpu = cpus[1] if len(cpus) > 1 else None
    p = ctx.Process(target=rank, args=(a.root, spec, a.streams, 0.0, 7, a.tokens, 0.0, cpu, q, a.profile), daemon=True)
    p.start()
    conn = listener.accept()
    recv_message(conn)                                   # hello
    params = {"max_tokens": a.max_tokens or 10**9, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None,
              "stop": []}
    prompt = list(range(1, a.prompt + 1))
    sent = 0

    def add(max_tokens: int | None = None) -> None:
        nonlocal sent
        fields = params if max_tokens is None else {**params, "max_tokens": max_tokens}
        send_message(conn, ("add", f"cmpl-{sent:024x}", prompt, fields, None, *hashes))
        sent += 1

    for i in range(a.streams):        # with --max-tokens the first ones end at staggered steps, as a server's do
        add(max(1, (i + 1) * a.max_tokens // a.streams) if a.max_tokens else None)
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        if conn.poll(0.01):
            if not a.max_tokens:
                conn.recv_bytes()
                continue
            msg = recv_message(conn)
            for _ in range(sum(1 for ev in msg[1] if ev[2] is not None) if msg[0] == "out" else 0):
                add()                                   # a request ended: its client sends the next
    send_message(conn, ("shutdown",))
    while True:                                   # to the rank's goodbye (its requests aborted)
        try:
            conn.recv_bytes()
        except EOFError:
            break
    r = q.get(timeout=30)
    p.join(30)
    listener.close()
    return r["rank_span_s"] / max(r["rank_steps"] - 1, 1) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=0, help="a request's tokens (0: it never ends)")
    ap.add_argument("--prompt", type=int, default=3, help="a request's prompt tokens")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--root", default=os.path.dirname(HERE))
    ap.add_argument("--link", default="tcp", help="tcp, unix or both (tcp,unix: run by run in turn)")
    ap.add_argument("--profile", help="the rank's loop under cProfile, its stats written here (one run, one link)")
    ap.add_argument("--json")
    a = ap.parse_args()
    a.root = os.path.abspath(a.root)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[0]})         # this process on one CPU, the rank on another
    kinds = a.link.split(",")
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(a.runs):
        for k in kinds:
            runs[k].append(one_run(a, cpus, k))
    print(f"{'root':<40}{'link':>6}{'streams':>8}{'tokens':>7}{'max':>6}{'us a step (median)':>20}  runs")
    for k in kinds:
        print(f"{a.root[-40:]:<40}{k:>6}{a.streams:>8}{a.tokens:>7}{a.max_tokens:>6}"
              f"{statistics.median(runs[k]):>20.1f}  " + " ".join(f"{x:.1f}" for x in runs[k]))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"root": a.root, "streams": a.streams, "tokens": a.tokens, "max_tokens": a.max_tokens,
                       "prompt": a.prompt, "seconds": a.seconds,
                       "rows": [{"link": k, "us_per_step_runs": runs[k], "us_per_step": statistics.median(runs[k])}
                                for k in kinds]}, fh, indent=1)


if __name__ == "__main__":
    main()
