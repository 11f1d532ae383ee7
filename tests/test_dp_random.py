"""A seeded randomized search over DP size, dp_sync, k, D, max_tokens and prompt lengths near both
limits (M and the drafter's window), through the real command: no hang (every run has a hard timeout) and
no output that differs from dp = 1. Bounded to about 20 s: `test_search.py` searches far more jobs
(every drafter, KV caches near the minimum) through the ranks' engine and job code, many per launch."""
import random
import time

import pytest

from dp_util import HARD_TIMEOUT_S, dp_config, read_out, run_cli, run_in_process, same_tokens, write_jsonl

BUDGET_S = 10
pytestmark = pytest.mark.timeout(BUDGET_S + 2 * HARD_TIMEOUT_S)


def scenario(rng: random.Random) -> dict:
    M = rng.randint(24, 72)
    k = rng.randint(1, 4)
    D = rng.choice([None, M, rng.randint(k + 2, M)])
    Dv = D or M
    near = [M - 1, M - 2, M - k - 1, Dv - k - 1, Dv - k, Dv - k + 1, 1, 2, rng.randint(1, M - 1)]
    n = rng.randint(1, 9)
    lengths = [max(1, min(M - 1, rng.choice(near))) for _ in range(n)]
    return {"dp": rng.choice([2, 3]), "dp_sync": rng.choice(["always", "never"]), "k": k, "M": M, "D": D,
            "method": rng.choice(["draft_model", "draft_model", "ngram"]),
            "requests": [{"prompt": [rng.randint(2, 300) for _ in range(L)],
                          "max_tokens": rng.choice([1, 2, k, k + 1, rng.randint(1, 40)])} for L in lengths]}


def test_random_scenarios_no_hang_no_difference(tmp_path, models, launches):
    rng = random.Random(20261129)
    start = time.monotonic()

    def draw(i):
        """Scenario i's run directory, input and config (the next draws of `rng`)."""
        sc = scenario(rng)
        d = tmp_path / f"s{i}"
        d.mkdir()
        inp = write_jsonl(d / "in.jsonl", sc["requests"])
        cfg = dp_config(d, models["target"], models["draft"], dp=sc["dp"], dp_sync=sc["dp_sync"], k=sc["k"],
                        M=sc["M"], D=sc["D"], method=sc["method"], max_num_seqs=rng.randint(1, 4))
        return sc, d, inp, cfg

    # the first two at once (a launch is nearly all start-up: they overlap), then one at a time within the budget
    first = [draw(i) for i in range(2)]
    for i, (_, d, inp, cfg) in enumerate(first):
        launches.start(i, "generate", cfg, "--input", inp, "--output", d / "out.jsonl")
    ran = 0
    while ran < 2 or time.monotonic() - start < BUDGET_S:
        sc, d, inp, cfg = first[ran] if ran < 2 else draw(ran)
        run_in_process(cfg, inp, d / "ref.jsonl")
        args = ("generate", cfg, "--input", inp, "--output", d / "out.jsonl")
        r, secs = launches.result(ran) if ran < 2 else run_cli(*args)
        assert r.returncode == 0, (sc, r.stderr[-3000:])
        diff = same_tokens(read_out(d / "ref.jsonl"), read_out(d / "out.jsonl"))
        assert diff == [], (sc, diff)
        ran += 1
