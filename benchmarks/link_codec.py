"""The rank link's codec (server/link.py): a served step's message encoded and decoded by marshal (the link's) and
by pickle (before session 33), µs a message, median of --repeats timings of --n messages each.

The message is a rank's step at --streams requests: ("out", events, steps per k, state), each event (a request id
as the frontend makes them, --tokens new token ids, no finish), one in --finished of them finished with its stats.
With --prompt N it is a request instead, as the frontend sends it: ("add", id, N prompt token ids, parameters, seed,
its block hashes: 16-token blocks, prefix caching on),
the ids as the API server has them (parsed from the request's JSON and copied, the parsed body still held: each id
referenced twice, which marshal's current version notes in its table of references), random in [0, --vocab);
marshal's version 2 (the link's for requests: no references) is measured beside the current one.

Usage: python benchmarks/link_codec.py [--streams 32] [--tokens 3] [--finished 8] [--prompt N [--vocab 32000]]
           [--n 20000] [--repeats 5] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import marshal
import os
import pickle
import random
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdp_cli.runtime.block_hash import block_hashes, joined  # noqa: E402


def step_message(streams: int, tokens: int, finished: int) -> tuple:
    stats = {"prompt_tokens": 120, "completion_tokens": 128, "num_drafts": 40, "num_draft_tokens": 120,
             "num_accepted_tokens": 80, "accepted_per_pos": [35, 28, 17], "preemptions": 0, "queue_s": 0.0002,
             "prefill_s": 0.0021, "decode_s": 0.121}
    events = [(f"cmpl-{uuid.uuid4().hex[:24]}", list(range(1000, 1000 + tokens)),
               "length" if finished and i % finished == 0 else None, None,
               stats if finished and i % finished == 0 else None, None) for i in range(streams)]
    return ("out", events, {3: 1}, (streams, 0, 0.42, 0, 1200, 1100, 300, 20, 1.2345, 1.0123, 57, 0.01234))


def request_message(prompt: int, vocab: int) -> tuple[tuple, dict]:
    """(the message, the parsed request body it came from, which the caller keeps alive as the frontend does)."""
    rng = random.Random(0)
    body = json.loads(json.dumps({"prompt": [rng.randrange(vocab) for _ in range(prompt)], "max_tokens": 128}))
    ids = list(body["prompt"])
    hashes = joined(block_hashes(ids, 16, [], (len(ids) - 1) // 16))
    return ("add", f"cmpl-{uuid.uuid4().hex[:24]}", ids, {"max_tokens": 128, "temperature": 0.0}, None, hashes), body


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
    ap.add_argument("--prompt", type=int, default=0, help="a request with this many prompt tokens (0: a step)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    msg, body = request_message(a.prompt, a.vocab) if a.prompt else (step_message(a.streams, a.tokens, a.finished),
                                                                      None)
    codecs = {"marshal": (marshal.dumps, marshal.loads),
              "marshal2": (lambda m: marshal.dumps(m, 2), marshal.loads),
              "pickle": (lambda m: pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads)}
    rows = []
    print(f"{'codec':<9}{'bytes':>7}{'encode us':>11}{'decode us':>11}")
    for name, (dumps, loads) in codecs.items():
        data = dumps(msg)
        assert loads(data) == msg
        row = {"codec": name, "bytes": len(data), "encode_us": per_message_us(dumps, msg, a.n, a.repeats),
               "decode_us": per_message_us(loads, data, a.n, a.repeats)}
        rows.append(row)
        print(f"{name:<9}{row['bytes']:>7}{row['encode_us']:>11.2f}{row['decode_us']:>11.2f}")
    del body                   # held until here, as the frontend holds a request's parsed body (request_message)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
