"""Data parallelism over real gloo ranks started by accelerate: outputs identical to dp = 1 in both
modes on skewed inputs, hangs recreated by fault injection caught at once, dead ranks reported,
two machines on loopback, and resume after a crash."""
import json
import shutil
import socket
import subprocess
import sys

import pytest

from dp_util import HARD_TIMEOUT_S, dp_config, read_out, run_cli, run_in_process, same_tokens, write_jsonl
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


def skewed_inputs(tmp, n_short=5):
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


@pytest.mark.parametrize("dp,dp_sync,n_short", [(2, "always", 5), (2, "never", 5), (3, "always", 1), (3, "never", 1)])
def test_dp_equals_dp1(tmp_path, models, eos_target, dp, dp_sync, n_short):
    # dp 3 with two inputs: one rank holds nothing at all
    rows = as_prompts(models, skewed_inputs(tmp_path, n_short))
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = dp_config(tmp_path, eos_target, models["draft"], dp=dp, dp_sync=dp_sync, k=K, M=M, D=D,
                    check=(dp_sync == "always"))
    run_in_process(cfg, inp, tmp_path / "ref.jsonl")
    ref = read_out(tmp_path / "ref.jsonl")
    assert any(r["finish_reason"] == "stop" for r in ref.values()), "no early eos in the reference"
    long = ref[json.dumps("r0")]
    assert long["prompt_tokens"] + long["completion_tokens"] > D - K, "the long request never reached the window"
    r, secs = run_cli("generate", cfg, "--input", inp, "--output", tmp_path / "out.jsonl",
                      "--summary-json", tmp_path / "s.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert same_tokens(ref, read_out(tmp_path / "out.jsonl")) == []
    summary = json.load(open(tmp_path / "s.json"))
    ranks = summary["ranks"]
    assert [x["rank"] for x in ranks] == list(range(dp))
    assert sum(x["requests"] for x in ranks) == len(rows)
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


def short_and_long(models, tmp):
    rows = [{"id": "long", "prompt": "def add(a, b):\n    return a + b\n", "max_tokens": 40},
            {"id": "short", "prompt": "for", "max_tokens": 2}]
    return write_jsonl(tmp / "in.jsonl", rows)


@pytest.mark.parametrize("fault", ["single-dummy-forward:1", "skip-drafter:1"])
def test_fault_out_of_step_is_caught_at_once(tmp_path, models, fault):
    inp = short_and_long(models, tmp_path)
    cfg = dp_config(tmp_path, models["target"], models["draft"], dp=2, dp_sync="always", k=3, M=128, timeout_s=60)
    r, secs = run_cli("generate", cfg, "--input", inp, "--output", tmp_path / "out.jsonl",
                      env={"SPECDP_FAULT": fault})
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr
    assert "out of step" in err and "rank 0 at step" in err and "rank 1 at step" in err, err
    assert "drafter forward" in err
    # caught by the tag in the sync, long before the 60 s collective timeout
    assert secs < 60, secs


def test_fault_exit_is_a_dead_rank(tmp_path, models):
    inp = short_and_long(models, tmp_path)
    cfg = dp_config(tmp_path, models["target"], models["draft"], dp=2, dp_sync="always", k=3, M=128, timeout_s=20)
    r, secs = run_cli("generate", cfg, "--input", inp, "--output", tmp_path / "out.jsonl",
                      env={"SPECDP_FAULT": "exit:1:3"})
    assert r.returncode == 1
    assert "rank 1 exited with status 3 during step 3" in r.stderr, r.stderr
    assert secs < 20 + 30 + 15


def test_check_collectives_without_faults_passes_and_faults_refused(tmp_path, models):
    inp = short_and_long(models, tmp_path)
    cfg = dp_config(tmp_path, models["target"], models["draft"], dp=2, dp_sync="always", check=True)
    r, _ = run_cli("generate", cfg, "--input", inp, "--output", tmp_path / "out.jsonl")
    assert r.returncode == 0, r.stderr
    r, _ = run_cli("generate", cfg, "--input", inp, "--output", tmp_path / "out.jsonl",
                   env={"SPECDP_FAULT": "exit:2:1"})
    assert r.returncode == 1 and "ranks are 0..1" in r.stderr


def test_resume_after_dead_rank_in_never_mode(tmp_path, models):
    # the ranks take inputs as they have room (which rank takes which depends on timing): the first four
    # finish within a few steps wherever they run; the rest need over 6 steps (at most k + 1 = 4 tokens a
    # step), so rank 1 still holds unfinished ones when it dies at its step 6
    rows = [{"prompt": r["prompt"], "max_tokens": r["max_tokens"]}          # ids: the line numbers
            for r in as_prompts(models, [{"prompt_ids": p, "max_tokens": 2 if i < 4 else 30}
                                         for i, p in enumerate(prompts_of_lengths([5] * 10, seed=31))])]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    cfg = dp_config(tmp_path, models["target"], models["draft"], dp=2, dp_sync="never", max_num_seqs=2)
    r, secs = run_cli("generate", cfg, "--input", inp, "--output", out, env={"SPECDP_FAULT": "exit:1:6"})
    assert r.returncode == 1 and "rank 1 exited with status 3 during step 6" in r.stderr, r.stderr
    assert not out.exists()
    parts = list(tmp_path.glob("out.jsonl.rank*.part"))
    assert parts and sum(1 for p in parts for _ in open(p)) < len(rows)
    r, _ = run_cli("generate", cfg, "--input", inp, "--output", out, "--summary-json", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    ids = [json.loads(x)["id"] for x in open(out)]
    assert ids == list(range(1, 11))
    assert json.load(open(tmp_path / "s.json"))["requests"] < len(rows)
    assert not list(tmp_path.glob("out.jsonl.rank*.part"))
    run_in_process(cfg, inp, tmp_path / "ref.jsonl")
    assert same_tokens(read_out(tmp_path / "ref.jsonl"), read_out(out)) == []


def test_straggler_rank_serves_fewer_inputs_without_lockstep(tmp_path, models):
    """Ranks take inputs as they have room: with rank 1 made 100 ms slower per step, rank 0 serves
    most of the inputs and the tokens still equal one rank's."""
    rows = [{"prompt": r["prompt"], "max_tokens": 8}
            for r in as_prompts(models, [{"prompt_ids": p, "max_tokens": 8}
                                         for p in prompts_of_lengths([4, 6, 8] * 4, seed=41)])]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = dp_config(tmp_path, models["target"], models["draft"], dp=2, dp_sync="never", max_num_seqs=2)
    r, _ = run_cli("generate", cfg, "--input", inp, "--output", tmp_path / "out.jsonl",
                   "--summary-json", tmp_path / "s.json", env={"SPECDP_FAULT": "slow:1:100"})
    assert r.returncode == 0, r.stderr
    ranks = json.load(open(tmp_path / "s.json"))["ranks"]
    assert sum(x["requests"] for x in ranks) == len(rows)
    assert ranks[0]["requests"] > ranks[1]["requests"] >= 1, ranks
    run_in_process(cfg, inp, tmp_path / "ref.jsonl")
    assert same_tokens(read_out(tmp_path / "ref.jsonl"), read_out(tmp_path / "out.jsonl")) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_on_loopback(tmp_path, models):
    rows = [{"prompt": f"class C{i}:", "max_tokens": 8} for i in range(4)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    port = free_port()
    procs = []
    for machine in (0, 1):
        cfg = dp_config(tmp_path, models["target"], models["draft"], dp=2, dp_sync="always", name=f"m{machine}.yaml",
                        parallel={"num_machines": 2, "machine_rank": machine, "main_process_port": port})
        args = ["generate", cfg, "--output", tmp_path / "out.jsonl"] + (["--input", inp] if machine == 0 else [])
        env = dict(__import__("os").environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen([sys.executable, "-m", "specdp_cli", *map(str, args)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=HARD_TIMEOUT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert [json.loads(x)["id"] for x in open(tmp_path / "out.jsonl")] == [1, 2, 3, 4]
