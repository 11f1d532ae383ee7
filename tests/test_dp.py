"""Data parallelism over real gloo ranks started by accelerate: outputs identical to dp = 1 in both
modes on skewed inputs, hangs recreated by fault injection caught at once, dead ranks reported,
two machines on loopback, and resume after a crash."""
import json
import os
import shutil
import socket

import pytest

from dp_util import HARD_TIMEOUT_S, dp_config, read_out, run_cli, run_in_process, same_tokens, selected, write_jsonl
from engine_util import hf_reference, prompts_of_lengths
from helpers import set_eos

pytestmark = pytest.mark.timeout(HARD_TIMEOUT_S * 3)

M, D, K = 64, 40, 3          # no-draft window [38, 63]


@pytest.fixture(scope="module")
def eos_target(tmp_path_factory, models):
    """The test target with a frequent output token made eos, so some sequences end early."""
    root = tmp_path_factory.mktemp("dp")
    prompts = prompts_of_lengths([4, 7, 9, 12, 15, 20], seed=11)
    outs = [hf_reference(models["target"], p, 16, eos=None) for p in prompts]
    counts = {}
    for o in outs:
        for t in set(o[2:]):
            counts[t] = counts.get(t, 0) + 1
    eos = max((t for t, c in counts.items() if c < len(outs)), key=counts.get)
    tdir = shutil.copytree(models["target"], root / "target")
    set_eos(tdir, eos)
    return tdir


def skewed_inputs(n_short=5):
    """One long request that crosses into the no-draft window (cost largest: rank 0 gets it),
    and short ones with mixed max_tokens that never reach it."""
    rows = [{"prompt_ids": p} for p in prompts_of_lengths([30], seed=21)]
    rows[0]["max_tokens"] = 30
    for i, p in enumerate(prompts_of_lengths([4 + 3 * i for i in range(n_short)], seed=22)):
        rows.append({"prompt_ids": p, "max_tokens": [2, 9, 16, 5, 12, 1][i % 6]})
    return rows


def as_prompts(models, rows):
    """Token ids -> text prompts (the CLI takes text); ids decode/encode stably for our tokenizer."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(models["tokenizer"]))
    out = []
    for i, r in enumerate(rows):
        text = tok.decode(r["prompt_ids"])
        out.append({"id": f"r{i}", "prompt": text, "max_tokens": r["max_tokens"]})
    return out


EQUALS = [(2, "always", 5), (2, "never", 5), (3, "always", 1), (3, "never", 1)]


def short_and_long(models, tmp):
    rows = [{"id": "long", "prompt": "def add(a, b):\n    return a + b\n", "max_tokens": 40},
            {"id": "short", "prompt": "for", "max_tokens": 2}]
    return write_jsonl(tmp / "in.jsonl", rows)


def resume_rows(models):
    # the ranks take inputs as they have room (which rank takes which depends on timing): the first four
    # finish within a few steps wherever they run; the rest need over 6 steps (at most k + 1 = 4 tokens a
    # step), so rank 1 still holds unfinished ones when it dies at its step 6
    return [{"prompt": r["prompt"], "max_tokens": r["max_tokens"]}          # ids: the line numbers
            for r in as_prompts(models, [{"prompt_ids": p, "max_tokens": 2 if i < 4 else 30}
                                         for i, p in enumerate(prompts_of_lengths([5] * 10, seed=31))])]


def crash_then_resume(tmp, cfg, inp, out, environ) -> dict:
    """The job with rank 1 exiting at its step 6, what it left, then the same command again."""
    first, secs = run_cli("generate", cfg, "--input", inp, "--output", out, env={"SPECDP_FAULT": "exit:1:6"},
                          base_env=environ)
    parts = tmp.glob("out.jsonl.rank*.part")
    left = {"out_exists": out.exists(), "part_lines": [sum(1 for _ in open(p)) for p in parts]}
    second, _ = run_cli("generate", cfg, "--input", inp, "--output", out, "--summary-json", tmp / "s.json",
                        base_env=environ)
    return {"first": first, "second": second, **left}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_machines(tmp, models, environ) -> list:
    """Two `generate` commands at once, machine 0 (with the input) and machine 1, of one dp 2 job on loopback:
    their (returncode, (stdout, stderr))."""
    from concurrent.futures import ThreadPoolExecutor

    rows = [{"prompt": f"class C{i}:", "max_tokens": 8} for i in range(4)]
    inp = write_jsonl(tmp / "in.jsonl", rows)
    port = free_port()
    commands = []
    for machine in (0, 1):
        cfg = dp_config(tmp, models["target"], models["draft"], dp=2, dp_sync="always", name=f"m{machine}.yaml",
                        parallel={"num_machines": 2, "machine_rank": machine, "main_process_port": port})
        commands.append(["generate", cfg, "--output", tmp / "out.jsonl"] + (["--input", inp] if machine == 0 else []))
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_cli, *args, base_env=environ) for args in commands]
        results = [run.result()[0] for run in runs]
    return [(r.returncode, (r.stdout, r.stderr)) for r in results]


@pytest.fixture(scope="module", autouse=True)
def dp_jobs(request, tmp_path_factory, models, launches) -> dict:
    """Every selected test's commands, started when this module starts (two at a time; a launch is nearly all process
    start-up): {key: (run directory, input, config)}; each test computes its dp 1 reference meanwhile and checks its
    own."""
    jobs = {}

    def add(key, make_cfg, rows=None, inp=None, **start):
        tmp = tmp_path_factory.mktemp("dp_job")
        inp = inp(tmp) if inp is not None else write_jsonl(tmp / "in.jsonl", rows)
        cfg = make_cfg(tmp)
        jobs[key] = (tmp, inp, cfg)
        return tmp, inp, cfg

    def cli(key, make_cfg, rows=None, inp=None, env=None, summary=False, exclusive=False):
        tmp, inp, cfg = add(key, make_cfg, rows, inp)
        launches.start(key, "generate", cfg, "--input", inp, "--output", tmp / "out.jsonl",
                       *(["--summary-json", tmp / "s.json"] if summary else []), env=env, exclusive=exclusive)

    for p in selected(request, "test_dp_equals_dp1"):
        dp, dp_sync, n_short = p["dp"], p["dp_sync"], p["n_short"]
        target = request.getfixturevalue("eos_target")
        cli(("equals", dp, dp_sync, n_short),
            lambda tmp: dp_config(tmp, target, models["draft"], dp=dp, dp_sync=dp_sync, k=K, M=M, D=D,
                                  check=(dp_sync == "always")),
            as_prompts(models, skewed_inputs(n_short)), summary=True)
    for p in selected(request, "test_fault_out_of_step_is_caught_at_once"):
        cli(("fault", p["fault"]), lambda tmp: dp_config(tmp, models["target"], models["draft"], dp=2, dp_sync="always",
                                                         k=3, M=128, timeout_s=60),
            inp=lambda tmp: short_and_long(models, tmp), env={"SPECDP_FAULT": p["fault"]}, exclusive=True)
    if selected(request, "test_fault_exit_is_a_dead_rank"):
        cli("exit", lambda tmp: dp_config(tmp, models["target"], models["draft"], dp=2, dp_sync="always", k=3, M=128,
                                          timeout_s=20),
            inp=lambda tmp: short_and_long(models, tmp), env={"SPECDP_FAULT": "exit:1:3"}, exclusive=True)
    if selected(request, "test_check_collectives_faults_are_refused"):
        cli("refused", lambda tmp: dp_config(tmp, models["target"], models["draft"], dp=2, dp_sync="always",
                                             check=True),
            inp=lambda tmp: short_and_long(models, tmp), env={"SPECDP_FAULT": "exit:2:1"})
    if selected(request, "test_resume_after_dead_rank_in_never_mode"):
        tmp, inp, cfg = add("resume", lambda tmp: dp_config(tmp, models["target"], models["draft"], dp=2,
                                                            dp_sync="never", max_num_seqs=2), resume_rows(models))
        launches.start("resume", tmp, cfg, inp, tmp / "out.jsonl", dict(os.environ), fn=crash_then_resume)
    if selected(request, "test_straggler_rank_serves_fewer_inputs_without_lockstep"):
        rows = [{"prompt": r["prompt"], "max_tokens": 8}
                for r in as_prompts(models, [{"prompt_ids": p, "max_tokens": 8}
                                             for p in prompts_of_lengths([4, 6, 8] * 4, seed=41)])]
        cli("straggler", lambda tmp: dp_config(tmp, models["target"], models["draft"], dp=2, dp_sync="never",
                                               max_num_seqs=2),
            rows, env={"SPECDP_FAULT": "slow:1:100"}, summary=True)
    if selected(request, "test_two_machines_on_loopback"):
        tmp = tmp_path_factory.mktemp("dp_job")
        jobs["machines"] = (tmp, None, None)
        launches.start("machines", tmp, models, dict(os.environ), fn=two_machines)
    return jobs


@pytest.mark.parametrize("dp,dp_sync,n_short", EQUALS)
def test_dp_equals_dp1(dp_jobs, launches, dp, dp_sync, n_short):
    # dp 3 with two inputs: one rank holds nothing at all; in lockstep every collective is checked
    # (check_collectives without faults passes)
    tmp_path, inp, cfg = dp_jobs[("equals", dp, dp_sync, n_short)]
    run_in_process(cfg, inp, tmp_path / "ref.jsonl")
    ref = read_out(tmp_path / "ref.jsonl")
    assert any(r["finish_reason"] == "stop" for r in ref.values()), "no early eos in the reference"
    long = ref[json.dumps("r0")]
    assert long["prompt_tokens"] + long["completion_tokens"] > D - K, "the long request never reached the window"
    r, secs = launches.result(("equals", dp, dp_sync, n_short))
    assert r.returncode == 0, r.stdout + r.stderr
    assert same_tokens(ref, read_out(tmp_path / "out.jsonl")) == []
    summary = json.load(open(tmp_path / "s.json"))
    ranks = summary["ranks"]
    assert [x["rank"] for x in ranks] == list(range(dp))
    assert sum(x["requests"] for x in ranks) == 1 + n_short
    stepped = [x for x in ranks if x["steps"]]
    assert min(x["start_offset_s"] for x in stepped) == 0
    assert all(0 < x["engine_s"] <= summary["engine_s"] + 1e-9 for x in stepped)
    assert all(x["start_offset_s"] + x["engine_s"] <= summary["engine_s"] + 1e-9 for x in stepped)
    if dp_sync == "always":
        steps = {x["steps"] for x in ranks}
        assert len(steps) == 1, "lockstep ranks ran different numbers of steps"
        assert any(x["padding_steps"] > 0 for x in ranks)
        assert all(x["skipped_drafter_steps"] == 0 for x in ranks)       # policy dummy
    if n_short == 1:
        assert min(x["requests"] for x in ranks) == 0


@pytest.mark.parametrize("fault", ["single-dummy-forward:1", "skip-drafter:1"])
def test_fault_out_of_step_is_caught_at_once(launches, fault):
    r, secs = launches.result(("fault", fault))
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr
    assert "out of step" in err and "rank 0 at step" in err and "rank 1 at step" in err, err
    assert "drafter forward" in err
    # caught by the tag in the sync, long before the 60 s collective timeout
    assert secs < 60, secs


def test_fault_exit_is_a_dead_rank(launches):
    r, secs = launches.result("exit")
    assert r.returncode == 1
    assert "rank 1 exited with status 3 during step 3" in r.stderr, r.stderr
    assert secs < 20 + 30 + 15


def test_check_collectives_faults_are_refused(launches):
    """A fault naming a rank the job does not have is refused (check_collectives without faults passes: see
    test_dp_equals_dp1, lockstep)."""
    r, _ = launches.result("refused")
    assert r.returncode == 1 and "ranks are 0..1" in r.stderr


def test_resume_after_dead_rank_in_never_mode(dp_jobs, launches):
    tmp_path, inp, cfg = dp_jobs["resume"]
    out = tmp_path / "out.jsonl"
    n_rows = sum(1 for _ in open(inp))
    run = launches.result("resume")
    r = run["first"]
    assert r.returncode == 1 and "rank 1 exited with status 3 during step 6" in r.stderr, r.stderr
    assert not run["out_exists"]
    assert run["part_lines"] and sum(run["part_lines"]) < n_rows
    r = run["second"]
    assert r.returncode == 0, r.stderr
    ids = [json.loads(x)["id"] for x in open(out)]
    assert ids == list(range(1, 11))
    assert json.load(open(tmp_path / "s.json"))["requests"] < n_rows
    assert not list(tmp_path.glob("out.jsonl.rank*.part"))
    run_in_process(cfg, inp, tmp_path / "ref.jsonl")
    assert same_tokens(read_out(tmp_path / "ref.jsonl"), read_out(out)) == []


def test_straggler_rank_serves_fewer_inputs_without_lockstep(dp_jobs, launches):
    """Ranks take inputs as they have room: with rank 1 made 100 ms slower per step, rank 0 serves
    most of the inputs and the tokens still equal one rank's."""
    tmp_path, inp, cfg = dp_jobs["straggler"]
    run_in_process(cfg, inp, tmp_path / "ref.jsonl")
    r, _ = launches.result("straggler")
    assert r.returncode == 0, r.stderr
    ranks = json.load(open(tmp_path / "s.json"))["ranks"]
    assert sum(x["requests"] for x in ranks) == 12
    assert ranks[0]["requests"] > ranks[1]["requests"] >= 1, ranks
    assert same_tokens(read_out(tmp_path / "ref.jsonl"), read_out(tmp_path / "out.jsonl")) == []


def test_two_machines_on_loopback(dp_jobs, launches):
    tmp_path = dp_jobs["machines"][0]
    done = launches.result("machines")
    assert [code for code, _ in done] == [0, 0], done
    assert [json.loads(x)["id"] for x in open(tmp_path / "out.jsonl")] == [1, 2, 3, 4]
