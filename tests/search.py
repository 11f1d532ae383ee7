"""A seeded randomized search for jobs that never end or that change the output (issue: "never loops").

Each scenario is a generate job drawn at random over what decides whether a sequence near its limits
can go on: the drafter (draft_model, ngram, eagle, eagle3, mtp), k and its schedule (fixed, ranges,
adaptive), the policy, dp_sync, max_num_seqs 1-6, the KV cache from the minimum (one full-length
sequence) up, block sizes, chunked prefill, prefix caching on and off with prompts that share prefixes, a
mixture-of-experts target (Qwen3-MoE, with expert parallelism at dp > 1) beside the dense one, and prompts at
M - 1 ... M - k - 2 and D - k +- 1. It runs
through the real rank code — `Engine` and the generate job's `run_rank` — on 1 rank in this process,
or on 2-3 gloo processes in one process group (`python tests/search.py RUN_DIR`, started by
`run_launched`), one scenario after another, so a launch's cost is paid once for many scenarios.
Every job must end (the progress guard turns a livelock into an error; a hang is killed by the
caller's timeout) and every greedy float32 output must equal transformers' target-only output.

Run it longer than the test suite does:
    python -m pytest tests/test_search.py --search-seconds 600 --search-seed 7
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

from specdp_cli.plan import async_method

METHODS = ["draft_model", "ngram", "eagle", "eagle3", "mtp"]
VOCAB = 300                  # prompt token ids are drawn below this (the test tokenizer has 320)


def scenario(rng: random.Random, models: dict, world: int) -> dict:
    """One job: {"config": the config's data, "requests": [{"id", "prompt_ids", "max_tokens", "speculative"}],
    "target": the target's directory}."""
    method = rng.choice(METHODS)
    k = rng.randint(1, 6)
    bs = rng.choice([4, 8, 16])
    M = rng.randint(max(24, 2 * k + 4), 96)
    D = rng.choice([None, None, M, rng.randint(k + 2, M)]) if method != "ngram" else None
    Dv = D or M
    nseq = rng.randint(1, 6)
    spec = {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "policy": rng.choice(["auto", "skip", "dummy"])}
    if method in models["drafters"]:
        spec["model"] = models["drafters"][method]
    if D is not None:
        spec["max_model_len"] = D
    schedule = rng.choice(["fixed", "ranges", "adaptive"])
    if schedule == "ranges":
        cut = rng.randint(1, 4)
        spec["num_speculative_tokens_per_batch_size"] = [[1, cut, rng.randint(0, k)], [cut + 1, 64, rng.randint(0, k)]]
    elif schedule == "adaptive":
        spec["adaptive"] = True
    min_blocks = -(-M // bs)
    num_blocks = rng.choice([None, min_blocks, min_blocks, min_blocks + 1, min_blocks + rng.randint(2, 3 * nseq)])
    parallel = {"data_parallel_size": world, "dp_sync": rng.choice(["always", "never"]) if world > 1 else "auto",
                "collective_timeout_s": 30}
    if method == "mtp" and world > 1 and parallel["dp_sync"] == "always" and rng.random() < 0.5:
        parallel["enable_expert_parallel"] = True
    target = models["mtp"] if method == "mtp" else models["target"]
    config = {"model": str(target), "max_model_len": M, "device": "cpu", "dtype": "float32",
              "speculative": spec, "parallel": parallel, "cache": {"block_size": bs, "num_blocks": num_blocks},
              "scheduler": {"max_num_seqs": nseq,
                            "max_num_batched_tokens": rng.choice([max(16, nseq * (k + 1)), 64, 256])}}
    near = [M - 1 - i for i in range(k + 2)] + [Dv - k - 1, Dv - k, Dv - k + 1]
    requests = []
    for i in range(rng.randint(1, 2 * nseq + 2)):
        L = max(1, min(M - 1, rng.choice(near + [rng.randint(1, M - 1)])))
        pattern = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 6))]     # repeats: n-gram lookup drafts
        prompt = [t if rng.random() < 0.9 else rng.randrange(2, VOCAB) for t in (pattern * L)[:L]]
        requests.append({"id": i, "prompt_ids": prompt, "max_tokens": rng.choice([1, 2, k, k + 1, rng.randint(1, 64)]),
                         "speculative": rng.random() < 0.9})
    if async_method(method):      # async scheduling: without drafts, or drafts proposed on the device (drawn last)
        config["scheduler"]["async_scheduling"] = rng.random() < 0.5
    # prefix caching (drawn after everything above, so a seed's earlier scenarios keep their other draws): on or off,
    # and in some jobs the prompts begin with a common prefix of random length, so that full blocks are shared,
    # hit, evicted and recomputed through preemption near M and D
    config["cache"]["enable_prefix_caching"] = rng.random() < 0.8
    if rng.random() < 0.5:
        common = [rng.randrange(2, VOCAB) for _ in range(M - 1)]
        for r in requests:
            shared = rng.randint(0, len(r["prompt_ids"]))
            r["prompt_ids"] = common[:shared] + r["prompt_ids"][shared:]
    # a mixture-of-experts target (Qwen3-MoE) for the drafters that do not come with one target (drawn last)
    if method in ("draft_model", "ngram") and "moe" in models and rng.random() < 0.3:
        target = models["moe"]
        config["model"] = str(target)
        if world > 1 and parallel["dp_sync"] == "always" and rng.random() < 0.5:
            parallel["enable_expert_parallel"] = True
    return {"config": config, "requests": requests, "target": str(target)}


def resolve(config: dict):
    """Config and plan for a scenario's config; a policy the preflight refuses falls back to auto."""
    from specdp_cli.config import validate
    from specdp_cli.preflight import run_preflight

    cfg = validate(config)
    report = run_preflight(cfg)
    if not report.ok and config["speculative"]["policy"] != "auto":
        return resolve({**config, "speculative": {**config["speculative"], "policy": "auto"}})
    if not report.ok and config["parallel"].get("enable_expert_parallel"):
        return resolve({**config, "parallel": {**config["parallel"], "enable_expert_parallel": False}})
    assert report.ok, (config, report.errors)
    return cfg, report.plan


def run_scenarios(dp, models: dict, run_dir: Path, seed: int, seconds: float, at_least: int = 2) -> int:
    """Run scenarios on this rank of `dp` (in lockstep with its other ranks) until `seconds` have passed;
    rank 0 writes each one's scenario (s{i}.json) and output (s{i}.out.jsonl). Returns how many ran."""
    import copy

    import torch

    from specdp_cli.jobs.generate import run_rank
    from specdp_cli.jobs.inputs import JobRequest
    from specdp_cli.runtime.engine import Engine

    torch.set_num_threads(1)
    deadline = time.monotonic() + seconds
    i = 0
    while dp.broadcast_object(i < at_least or time.monotonic() < deadline, "next scenario"):
        sc = scenario(random.Random(f"{seed}/{dp.world}/{i}"), models, dp.world)
        cfg, plan = resolve(sc["config"])
        if dp.rank == 0:
            (run_dir / f"s{i}.json").write_text(json.dumps(sc))
        group = dp
        if dp.world > 1 and dp.lockstep != plan.lockstep:     # the same process group, stepping alone (dp_sync never)
            group = copy.copy(dp)
            group.lockstep = plan.lockstep
        engine = Engine(cfg, plan, group, torch.device("cpu"))
        reqs = [JobRequest(id=r["id"], line=n + 1, prompt_ids=r["prompt_ids"],
                           params={"max_tokens": r["max_tokens"], "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                   "stop": [], "speculative": r["speculative"]},
                           fingerprint={"job": "search", "input": str(n)}) for n, r in enumerate(sc["requests"])]
        run_rank(engine, group, str(run_dir / f"s{i}.out.jsonl"), False, reqs if dp.rank == 0 else None,
                 dp.rank == 0, pool_path=str(run_dir / f"s{i}.claims") if dp.world > 1 else None)
        (run_dir / f"cache{i}.rank{dp.rank}.json").write_text(json.dumps(
            {"queries": engine.pool.queries, "hits": engine.pool.hits, "preemptions": engine.counters.preemptions}))
        i += 1
    return i


def summary(run_dir: Path, models: dict) -> str:
    """What the scenarios covered: jobs on the mixture-of-experts target and, over all ranks, prefix cache block
    queries and hits, preemptions, and the jobs in which a rank had both."""
    moe = sum(1 for p in run_dir.glob("s*.json") if json.loads(p.read_text())["target"] == models.get("moe"))
    stats = [json.loads(p.read_text()) for p in run_dir.glob("cache*.rank*.json")]
    both = sum(1 for st in stats if st["hits"] and st["preemptions"])
    return (f"{moe} on the MoE target; prefix cache {sum(st['hits'] for st in stats)} hits of "
            f"{sum(st['queries'] for st in stats)} queries, {sum(st['preemptions'] for st in stats)} preemptions, "
            f"{both} rank-jobs with hits and preemptions")


def check_outputs(run_dir: Path, count: int) -> list[str]:
    """Each scenario's outputs against transformers' greedy target-only tokens: the differences found."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_util import greedy_up_to_ties, hf_reference

    bad = []
    for i in range(count):
        sc = json.loads((run_dir / f"s{i}.json").read_text())
        M = sc["config"]["max_model_len"]
        out = {rec["id"]: rec for rec in map(json.loads, open(run_dir / f"s{i}.out.jsonl"))}
        for r in sc["requests"]:
            rec = out.get(r["id"], {})
            n = min(r["max_tokens"], M - len(r["prompt_ids"]))
            ref = hf_reference(sc["target"], r["prompt_ids"], n)
            got = rec.get("token_ids")
            # (where transformers' logits tie within float32's last bits, the engine may pick the other token)
            if got != ref and (got is None or greedy_up_to_ties(sc["target"], r["prompt_ids"], got, n) is not None):
                bad.append(f"scenario {i} request {r['id']} (prompt {len(r['prompt_ids'])} tokens): "
                           f"{rec.get('token_ids', rec.get('error'))} != {ref}; config {sc['config']}")
    return bad


def run_launched(models: dict, run_dir: Path, world: int, seed: int, seconds: float, timeout: float) -> int:
    """run_scenarios on `world` gloo processes of one machine; returns how many scenarios ran. A rank that
    fails (the progress guard, ranks out of step) or a job that does not end within `timeout` fails here,
    naming the scenario."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (run_dir / "models.json").write_text(json.dumps(models))
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        log = open(run_dir / f"rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, __file__, str(run_dir), str(seed), str(seconds)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if any(p.returncode for p in procs):
        ran = len(list(run_dir.glob("s*.json")))
        logs = "\n".join(f"--- rank {r} ---\n" + (run_dir / f"rank{r}.log").read_text()[-3000:] for r in range(world))
        last = (run_dir / f"s{ran - 1}.json").read_text() if ran else "(none)"
        raise AssertionError(f"dp {world}: scenario {ran - 1} did not end well (killed after {timeout:.0f} s, or a "
                             f"rank failed): {last}\n{logs}")
    return int((run_dir / "count").read_text())


def _rank_main() -> None:
    """A rank of `run_launched`: argv = RUN_DIR SEED SECONDS."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from specdp_cli.runtime.dist import DPGroup
    from specdp_cli.runtime.status import StatusBoard

    run_dir, seed, seconds = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    models = json.loads((run_dir / "models.json").read_text())
    rank = int(os.environ["RANK"])
    dp = DPGroup.from_env("gloo", True, 30.0, False, torch.device("cpu"), StatusBoard(None, rank))
    try:
        n = run_scenarios(dp, models, run_dir, seed, seconds)
    except Exception:  # noqa: BLE001 - the log says what failed; the caller names the scenario
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    if rank == 0:
        (run_dir / "count").write_text(str(n))
    dp.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    _rank_main()
