"""The rank link's codec (server/link.py): a served step's message encoded and decoded by marshal (the link's) and
by pickle (before session 33), µs a message, median of --repeats timings of --n messages each.

The message is a rank's step at --streams requests: ("out", events, steps per k, state), each event (a request id
as the frontend makes them, --tokens new token ids, no finish), one in --finished of them finished with its stats.

Usage: python benchmarks/link_codec.py [--streams 32] [--tokens 3] [--finished 8] [--n 20000] [--repeats 5]
           [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import marshal
import pickle
import statistics
import time
import uuid


def step_message(streams: int, tokens: int, finished: int) -> tuple:
    stats = {"prompt_tokens": 120, "completion_tokens": 128, "num_drafts": 40, "num_draft_tokens": 120,
             "num_accepted_tokens": 80, "accepted_per_pos": [35, 28, 17], "preemptions": 0, "queue_s": 0.0002,
             "prefill_s": 0.0021, "decode_s": 0.121}
    events = [(f"cmpl-{uuid.uuid4().hex[:24]}", list(range(1000, 1000 + tokens)),
               "length" if finished and i % finished == 0 else None, None,
               stats if finished and i % finished == 0 else None, None) for i in range(streams)]
    return ("out", events, {3: 1}, (streams, 0, 0.42, 0, 1200, 1100, 300, 20, 1.2345, 1.0123))


def per_message_us(fn, arg, n: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn(arg)
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--finished", type=int, default=8, help="one in this many events finished (0: none)")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    msg = step_message(a.streams, a.tokens, a.finished)
    codecs = {"marshal": (marshal.dumps, marshal.loads),
              "pickle": (lambda m: pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads)}
    rows = []
    print(f"{'codec':<8}{'bytes':>7}{'encode us':>11}{'decode us':>11}")
    for name, (dumps, loads) in codecs.items():
        data = dumps(msg)
        assert loads(data) == msg
        row = {"codec": name, "bytes": len(data), "encode_us": per_message_us(dumps, msg, a.n, a.repeats),
               "decode_us": per_message_us(loads, data, a.n, a.repeats)}
        rows.append(row)
        print(f"{name:<8}{row['bytes']:>7}{row['encode_us']:>11.2f}{row['decode_us']:>11.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
