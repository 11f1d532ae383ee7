"""The step's k across real gloo ranks: in lockstep every rank uses the agreed k even when the ranks'
own choices differ (forced by the test hook), with `check_collectives` clean and the tokens of
dp 1; adaptive k over 3 ranks likewise; a rank that then plans another drafter-forward count is
still caught as out of step."""
import json

import pytest

from dp_util import (HARD_TIMEOUT_S, dp_config, generate_args, read_out, run_in_process, same_tokens, selected,
                     text_rows, write_jsonl)
from specdp_cli.runtime.spec_length import TEST_ENV

pytestmark = pytest.mark.timeout(HARD_TIMEOUT_S * 3)


def lockstep_job(tmp_path, models, dp, **spec):
    """(input, config) of a lockstep job with every collective checked, over requests of mixed lengths."""
    tmp_path.mkdir(exist_ok=True)
    rows = text_rows(models["tokenizer"], [5, 9, 14, 20, 26], [16, 6, 12, 16, 3], seed=31)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    return inp, dp_config(tmp_path, models["target"], models["draft"], dp=dp, dp_sync="always", k=3, M=64, check=True,
                          speculative=spec)


def caught_job(tmp_path, models):
    """(input, config) of a lockstep job whose k schedule drafts at one sequence, 60 s of collective timeout."""
    rows = [{"id": "long", "prompt": "def add(a, b):\n    return a + b\n", "max_tokens": 40},
            {"id": "short", "prompt": "for", "max_tokens": 2}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    return inp, dp_config(tmp_path, models["target"], models["draft"], dp=2, dp_sync="always", k=3, M=128, timeout_s=60,
                          speculative={"num_speculative_tokens_per_batch_size": [[1, 1, 2]]})


@pytest.fixture(scope="module", autouse=True)
def spec_jobs(request, tmp_path_factory, models, launches) -> dict:
    """Every selected test's commands, started when this module starts (two at a time): {key: (run directory,
    input, config)}."""
    jobs = {}

    def add(key, name, make, env, *args, **spec):
        tmp = tmp_path_factory.mktemp(name)
        inp, cfg = make(tmp, models, *args, **spec)
        jobs[key] = (tmp, inp, cfg)
        launches.start(key, *generate_args(tmp, inp, cfg), env=env, exclusive=key == "caught")   # its wall time bounded

    if selected(request, "test_lockstep_ranks_agree_when_their_choices_differ"):
        add("agree", "agree", lockstep_job, {TEST_ENV: "0:3,0,2,0,1;1:0,3,1,3"}, 2, adaptive=True)
    if selected(request, "test_adaptive_over_three_ranks"):
        add("adaptive", "adaptive", lockstep_job, {TEST_ENV: "0:1,3;1:0,2,3;2:3,0"}, 3, adaptive=True)
        add("plain", "plain", lockstep_job, None, 3, num_speculative_tokens_per_batch_size=[[1, 1, 1], [2, 4, 2]])
    if selected(request, "test_a_rank_planning_other_forwards_than_agreed_is_caught"):
        add("caught", "caught", caught_job, {"SPECDP_FAULT": "skip-drafter:1"})
    return jobs


def run_lockstep(jobs, launches, key):
    """The job `key` of `spec_jobs` ended well with the tokens of dp 1 (computed here while it runs); its summary."""
    tmp_path, inp, cfg = jobs[key]
    run_in_process(cfg, inp, tmp_path / "ref.jsonl")
    r, _ = launches.result(key)
    assert r.returncode == 0, r.stdout + r.stderr
    assert same_tokens(read_out(tmp_path / "ref.jsonl"), read_out(tmp_path / "out.jsonl")) == []
    return json.load(open(tmp_path / "s.json"))


def test_lockstep_ranks_agree_when_their_choices_differ(spec_jobs, launches):
    s = run_lockstep(spec_jobs, launches, "agree")
    assert len({r["steps"] for r in s["ranks"]}) == 1
    steps = s["speculation"]["steps_by_k"]
    assert s["speculation"]["mode"] == "adaptive"
    assert len(steps) >= 3 and "0" in steps, steps          # k toggles to 0 and back
    assert s["num_drafts"] > 0


def test_adaptive_over_three_ranks(spec_jobs, launches):
    s = run_lockstep(spec_jobs, launches, "adaptive")
    assert len({r["steps"] for r in s["ranks"]}) == 1
    s2 = run_lockstep(spec_jobs, launches, "plain")
    assert set(s2["speculation"]["steps_by_k"]) <= {"1", "2", "3"}


def test_a_rank_planning_other_forwards_than_agreed_is_caught(launches):
    r, secs = launches.result("caught")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "out of step" in r.stderr and "drafter forward" in r.stderr, r.stderr
    assert secs < 60
