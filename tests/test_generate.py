"""`specdp generate` on one rank: input handling, per-line errors, output order and fields, the
summary, exit codes, resuming, and the demo pair."""
import json

import pytest
from typer.testing import CliRunner

from engine_util import hf_reference
from helpers import REPO, write_config
from specdp_cli.cli import app

runner = CliRunner()
SUMMARY_KEYS = {"requests", "errors", "prompt_tokens", "generated_tokens", "wall_s", "engine_s", "tok_s", "num_drafts",
                "num_draft_tokens", "num_accepted_tokens", "acceptance_rate", "mean_acceptance_length",
                "accepted_per_position", "preemptions", "startup", "launch_phases", "ranks", "resumed",
                "speculation", "weights_per_token", "prefix_cache"}
RESULT_KEYS = {"id", "text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "spec",
               "fingerprint"}


@pytest.fixture
def cfg(models, tmp_path):
    return write_config(tmp_path / "c.yaml", {
        "model": str(models["target"]), "max_model_len": 48, "device": "cpu",
        "speculative": {"model": str(models["draft"]), "num_speculative_tokens": 3},
        "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 64}, "sampling": {"max_tokens": 12}})


def lines(path):
    return [json.loads(x) for x in open(path)]


def write_jsonl(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def generate(cfg, inp, out, *args, env=None):
    return runner.invoke(app, ["generate", str(cfg), "--input", str(inp), "--output", str(out), *args], env=env)


def test_jsonl_opt_out_and_steps_by_k(cfg, tmp_path):
    rows = [{"id": i, "prompt": p, "speculative": i != 1} for i, p in enumerate(["def add(a, b):", "class Point:"])]
    inp = write_jsonl(tmp_path / "in.jsonl", rows + [{"id": 2, "prompt": "x", "speculative": "no"}])
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    res = generate(cfg, inp, out, "--summary-json", str(summary), "--set",
                   "speculative.num_speculative_tokens_per_batch_size=[[1, 1, 0]]")
    assert res.exit_code == 0, res.output
    by = {r["id"]: r for r in lines(out)}
    assert by[1]["spec"]["num_drafts"] == 0 and by[0]["spec"]["num_drafts"] > 0
    assert "speculative must be true or false" in by[2]["error"]
    spec = json.load(open(summary))["speculation"]
    assert spec["mode"] == "per batch size" and set(spec["steps_by_k"]) <= {"0", "3"}
    assert "steps by k" in res.output


def test_jsonl_job_with_bad_lines(cfg, tmp_path, models):
    long_prompt = "def add(a, b):\n    return a + b\n" * 20
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "def add(a, b):"},                                      # id 1
        {"prompt": "class Point:", "id": "point", "max_tokens": 5},
        "{this is not json",                                               # id 3
        "",                                                                # blank: skipped
        {"prompt": long_prompt},                                           # id 5: prompt >= M
        {"messages": [{"role": "user", "content": "hi"}]},                 # id 6: no chat template
        {"prompt": "import os", "top_p": 2},                               # id 7: out of range
        {"prompt": "for i in range(10):\n    print(i", "max_tokens": 100},  # id 8: stops at M
        {"nothing": "here"},                                               # id 9
        {"prompt": "while True:", "stop": ["\n"], "id": 10},
        {"prompt": list(range(2, 43)), "id": 11},                          # 41 tokens, no max_tokens: M - 41 = 7 < 12
        {"prompt": "x = 1", "extra_key": 1, "id": 12},                     # a key no request has: refused by name
    ])
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    res = generate(cfg, inp, out, "--summary-json", str(summary))
    assert res.exit_code == 0, res.output
    rows = lines(out)
    assert [r["id"] for r in rows] == [1, "point", 3, 5, 6, 7, 8, 9, 10, 11, 12]
    by = {r["id"]: r for r in rows}
    for bad in (3, 5, 6, 7, 9, 12):
        assert set(by[bad]) == {"id", "error", "fingerprint"}, by[bad]
    assert "JSON" in by[3]["error"] and "max_model_len" in by[5]["error"] and "chat template" in by[6]["error"]
    assert "top_p" in by[7]["error"] and "prompt" in by[9]["error"] and "unknown field 'extra_key'" in by[12]["error"]
    for good in (1, "point", 8, 10, 11):
        assert set(by[good]) == RESULT_KEYS
        assert set(by[good]["spec"]) == {"num_drafts", "num_draft_tokens", "num_accepted_tokens"}
        assert by[good]["completion_tokens"] == len(by[good]["token_ids"])
    assert by["point"]["completion_tokens"] <= 5
    for at_m in (8, 11):            # max_tokens past the room the prompt leaves, or none and less room than the default
        assert by[at_m]["prompt_tokens"] + by[at_m]["completion_tokens"] == 48 and by[at_m]["finish_reason"] == "length"
    if by[10]["finish_reason"] == "stop":
        assert "\n" not in by[10]["text"]
    # greedy output equals the reference
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(models["target"]))
    ids = tok("def add(a, b):")["input_ids"]
    assert by[1]["token_ids"] == hf_reference(models["target"], ids, 12)
    s = json.load(open(summary))
    assert set(s) == SUMMARY_KEYS
    assert s["requests"] == 11 and s["errors"] == 6
    assert s["generated_tokens"] == sum(by[g]["completion_tokens"] for g in (1, "point", 8, 10, 11))
    assert s["acceptance_rate"] is None or 0 <= s["acceptance_rate"] <= 1
    assert len(s["ranks"]) == 1 and set(s["ranks"][0]) == {"rank", "requests", "steps", "padding_steps",
                                                           "skipped_drafter_steps", "generated_tokens", "preemptions",
                                                           "planned_ahead", "chunk_steps", "weight_bytes",
                                                           "expert_weight_bytes",
                                                           "graphs", "engine_s", "start_offset_s", "gc_collections",
                                                           "gc_pause_s", "prefix_cache"}
    # start-up froze the heap: what collections came after it are counted, and are short
    assert s["ranks"][0]["gc_collections"] >= 0 and 0 <= s["ranks"][0]["gc_pause_s"] < s["engine_s"]
    assert s["ranks"][0]["start_offset_s"] == 0 and abs(s["ranks"][0]["engine_s"] - s["engine_s"]) < 1e-9
    assert s["ranks"][0]["weight_bytes"] is None and s["ranks"][0]["expert_weight_bytes"] == 0     # CPU, dense
    assert 0 < s["ranks"][0]["chunk_steps"] < s["ranks"][0]["steps"]     # the prompts rode in wide steps, not all
    assert s["preemptions"] == 0
    assert set(s["startup"]) == {"launch_s", "load_s", "kv_alloc_s", "capture_s"}
    assert all(v >= 0 for v in s["startup"].values()) and s["startup"]["load_s"] > 0
    assert s["wall_s"] >= s["engine_s"] + s["startup"]["load_s"]
    assert set(s["launch_phases"]) == {"cli_s", "spawn_s", "imports_s", "job_wait_s", "join_s"}
    assert abs(sum(s["launch_phases"].values()) - s["startup"]["launch_s"]) < 0.05   # the phases add up
    assert "acceptance" in res.stdout


def test_plain_text_input_and_chat_template(cfg, tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("def add(a, b):\n\nclass Point:\n")
    out = tmp_path / "out.jsonl"
    assert generate(cfg, inp, out).exit_code == 0
    assert [r["id"] for r in lines(out)] == [1, 3]
    tmpl = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    inp2 = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    out2 = tmp_path / "chat-out.jsonl"
    res = generate(cfg, inp2, out2, "--set", f"chat_template={json.dumps(tmpl)}")
    assert res.exit_code == 0, res.output
    assert "text" in lines(out2)[0]


def test_nothing_drafted_gives_nulls_not_nan(cfg, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x", "max_tokens": 1}])
    summary = tmp_path / "s.json"
    assert generate(cfg, inp, tmp_path / "o.jsonl", "--summary-json", str(summary)).exit_code == 0
    s = json.load(open(summary))
    assert s["acceptance_rate"] is None and s["mean_acceptance_length"] is None and s["accepted_per_position"] == []


def test_refusals_and_usage_errors(cfg, tmp_path):
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"prompt": "a", "id": 2}, {"prompt": "b"}])
    res = generate(cfg, dup, tmp_path / "o.jsonl")
    assert res.exit_code == 1 and "duplicate id 2 on lines 1 and 2" in res.output
    assert generate(cfg, tmp_path / "missing.jsonl", tmp_path / "o.jsonl").exit_code == 2
    assert generate(cfg, dup, tmp_path / "no" / "dir" / "o.jsonl").exit_code == 2
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a"}])
    assert generate(cfg, ok, tmp_path / "o.jsonl", "--set", "speculative.num_speculative_tokens=0").exit_code == 1
    res = generate(cfg, ok, tmp_path / "o.jsonl", env={"SPECDP_FAULT": "exit:1:3"})
    assert res.exit_code == 1 and "ranks are 0..0" in res.output
    res = generate(cfg, ok, tmp_path / "o.jsonl", env={"SPECDP_FAULT": "explode"})
    assert res.exit_code == 1 and "cannot read" in res.output


def test_fault_exit_then_resume(cfg, tmp_path):
    rows = [{"prompt": f"def f{i}(x):", "max_tokens": 12} for i in range(8)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    res = generate(cfg, inp, out, env={"SPECDP_FAULT": "exit:0:4"})
    assert res.exit_code == 1 and "rank 0 exited with status 3 during step 4" in res.output
    part = tmp_path / "out.jsonl.rank0.part"
    done_before = lines(part)
    assert 0 < len(done_before) < 8 and not out.exists()
    summary = tmp_path / "s.json"
    res = generate(cfg, inp, out, "--summary-json", str(summary))
    assert res.exit_code == 0, res.output
    ids = [r["id"] for r in lines(out)]
    assert ids == list(range(1, 9))                              # every input exactly once, in order
    assert json.load(open(summary))["requests"] == 8 - len(done_before)
    assert not part.exists()
    # a third run has nothing left to do and rewrites the same output
    before = out.read_text()
    assert generate(cfg, inp, out).exit_code == 0
    assert out.read_text() == before


def test_torn_part_line_is_ignored(cfg, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "out.jsonl"
    assert generate(cfg, inp, out).exit_code == 0
    fp = lines(out)[0]["fingerprint"]                 # what this job stamps on line 1
    out.unlink()
    old = {"id": 1, "error": "old", "fingerprint": fp}
    (tmp_path / "out.jsonl.rank0.part").write_text(json.dumps(old) + "\n{\"id\": 2, \"te")
    assert generate(cfg, inp, out).exit_code == 0
    rows = lines(out)
    assert rows[0] == old and "text" in rows[1]
    assert generate(cfg, inp, out, "--retry-errors").exit_code == 0
    assert "text" in lines(out)[0]


def test_demo_pair_runs_and_reports_acceptance(tmp_path):
    out, summary = tmp_path / "demo.jsonl", tmp_path / "s.json"
    res = runner.invoke(app, ["generate", str(REPO / "configs" / "demo.yaml"), "--input", str(REPO / "demo" / "prompts.jsonl"),
                              "--output", str(out), "--summary-json", str(summary), "--set", "sampling.max_tokens=24"])
    assert res.exit_code == 0, res.output
    s = json.load(open(summary))
    assert s["requests"] == len(lines(REPO / "demo" / "prompts.jsonl"))
    assert s["acceptance_rate"] is not None and s["acceptance_rate"] > 0.2
    assert "acceptance rate" in res.stdout


def test_ranks_started_early_are_stopped_when_the_job_is_refused(cfg, tmp_path):
    """With dp 2 the ranks start before preflight (they import while it runs); a refused config, a
    missing input, bad input lines that refuse the job: each ends them and removes their run directory."""
    import glob
    import tempfile
    import time

    import psutil

    pattern = f"{tempfile.gettempdir()}/specdp-run-*"
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a"}])
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"prompt": "a", "id": 2}, {"prompt": "b"}])
    for inp, extra, code in ((ok, ["--set", "model=/nonexistent"], 1), (tmp_path / "missing.jsonl", [], 2),
                             (dup, [], 1)):
        runs_before = set(glob.glob(pattern))
        res = generate(cfg, inp, tmp_path / "o.jsonl", "--dp", "2", *extra)
        assert res.exit_code == code, res.output
        assert set(glob.glob(pattern)) <= runs_before                 # the run directory is gone

        def ranks_of_this_run():
            out = []
            for p in psutil.process_iter(["cmdline"]):
                cmd = " ".join(p.info["cmdline"] or [])
                if f"{tempfile.gettempdir()}/specdp-run-" in cmd and not any(d in cmd for d in runs_before):
                    out.append(cmd)
            return out

        deadline = time.monotonic() + 15                              # killed, or leaving by themselves
        while ranks_of_this_run():
            assert time.monotonic() < deadline, ranks_of_this_run()
            time.sleep(0.1)


def test_progress_lines_when_stderr_is_no_terminal():
    """A log file or CI sees a progress line every interval (done/total, tok/s, elapsed, ETA)."""
    import io
    import time

    from rich.console import Console

    from specdp_cli.jobs.run_generate import ProgressLines

    buf = io.StringIO()
    with ProgressLines(Console(file=buf, force_terminal=False, width=200), 200, 10, every=0.05) as pl:
        pl.done, pl.tokens = 60, 3200
        deadline = time.monotonic() + 10
        while buf.getvalue().count("\n") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    first = buf.getvalue().splitlines()[0]
    assert first.startswith("generate: 60/200 done, ") and "tok/s" in first and "elapsed" in first and "eta" in first


def test_usage_errors_come_before_any_work(cfg, tmp_path):
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "a"}])
    res = generate(cfg, ok, tmp_path / "o.jsonl", "--device", "foo")
    assert res.exit_code == 2 and "--device must be one of cpu, cuda, auto" in res.output
    res = generate(cfg, ok, tmp_path)                                   # --output names a folder
    assert res.exit_code == 2 and "--output names a folder" in res.output
    res = generate(cfg, tmp_path / "missing.jsonl", tmp_path / "o.jsonl", "--set", "model=/nonexistent")
    assert res.exit_code == 2 and "input file not found" in res.output  # before preflight's complaint
    assert not list(tmp_path.glob("o.jsonl*")) and not list(tmp_path.glob("*.part"))


@pytest.mark.parametrize("dp", [1, 2])
def test_sigterm_stops_with_a_sentence_and_143(cfg, tmp_path, dp):
    """SIGTERM mid-job: exit 143 with a sentence, finished results kept, no run directory left in the temp
    folder; on the way each rank's start-up line was shown, and no progress bar (stderr is no terminal)."""
    import os
    import signal
    import time

    from cli_forks import FORKS

    inp = write_jsonl(tmp_path / "many.jsonl", [{"prompt": f"def f{i}(x):", "max_tokens": 12} for i in range(400)])
    out = tmp_path / "o.jsonl"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # the command in a process of its own (as `python -m specdp_cli generate ...`, forked from a helper that imported it)
    proc = FORKS.start(["generate", str(cfg), "--input", str(inp), "--output", str(out), "--dp", str(dp)],
                       dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp), GLOO_SOCKET_IFNAME="lo"), os.getcwd())
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size > 0 for p in tmp_path.glob("o.jsonl.rank*.part")):     # the job is running
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM; finished results are kept" in err and "rerun the same command to resume" in err
    assert list(tmp_path.glob("o.jsonl.rank*.part"))
    assert not list(tmp.glob("specdp-run-*")), list(tmp.iterdir())
    assert all(f"rank {r} ready in" in err for r in range(dp)), err
    assert "━" not in err


def test_resume_reuses_only_what_the_same_job_made(cfg, tmp_path):
    """A finished line is reused only when its fingerprint matches; a changed job or line stops the run
    before any work with what changed; --overwrite starts afresh; the data-parallel size is no change."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "def add(a, b):", "max_tokens": 6},
                                              {"prompt": "class Point:", "max_tokens": 6}])
    out = tmp_path / "out.jsonl"
    assert generate(cfg, inp, out).exit_code == 0
    first = out.read_bytes()

    res = generate(cfg, inp, out, "--summary-json", str(tmp_path / "s.json"))          # the same job: all reused
    assert res.exit_code == 0 and "resuming: 2 of 2" in res.output
    s = json.load(open(tmp_path / "s.json"))
    assert s["resumed"] == 2 and s["requests"] == 0 and out.read_bytes() == first

    for extra, what in ((["--set", "speculative.method=none"], "the decoding settings (method draft_model -> none"),
                        (["--set", "sampling.temperature=1.0"], "line 1 (id 1) changed"),
                        (["--set", "seed=7"], "the decoding settings (seed 0 -> 7)")):
        res = generate(cfg, inp, out, *extra)
        assert res.exit_code == 1 and what in res.output and "--overwrite" in res.output, res.output
        assert out.read_bytes() == first and not list(tmp_path.glob("out.jsonl.rank*.part"))   # no work done

    changed = write_jsonl(tmp_path / "in2.jsonl", [{"prompt": "def add(a, b):", "max_tokens": 6},
                                                   {"prompt": "class Circle:", "max_tokens": 6}])
    res = generate(cfg, changed, out)
    assert res.exit_code == 1 and "line 2 (id 2) changed since its result" in res.output

    res = generate(cfg, inp, out, "--set", "speculative.method=none", "--overwrite",
                   "--summary-json", str(tmp_path / "s2.json"))
    assert res.exit_code == 0, res.output
    assert json.load(open(tmp_path / "s2.json"))["resumed"] == 0
    assert all(r["spec"]["num_drafts"] == 0 for r in lines(out))

    res = generate(cfg, inp, out, "--set", "speculative.method=none", "--dp", "2",
                   "--summary-json", str(tmp_path / "s3.json"))                       # dp size is not in it
    assert res.exit_code == 0, res.output
    assert json.load(open(tmp_path / "s3.json"))["resumed"] == 2


def test_start_time_of_a_process_a_shell_exec_ed(monkeypatch):
    """`bash -c 'pip install ...; specdp generate ...'` execs specdp in the shell's process: its fork time
    is the shell's, so the start-up figures would count the shell's earlier work; the import time is used."""
    import time

    import specdp_cli
    from specdp_cli import launch

    now = time.time()
    monkeypatch.setattr(specdp_cli, "IMPORTED_AT", now)
    monkeypatch.setattr(launch, "_forked_at", lambda: now - 0.8)          # started, then imported specdp
    assert launch.process_start_time() == now - 0.8
    monkeypatch.setattr(launch, "_forked_at", lambda: now - 80)           # a shell's pip install, then exec
    assert launch.process_start_time() == now


def test_intra_op_threads_of_a_rank(monkeypatch):
    """A GPU rank takes one intra-op thread (its host work is one Python thread, which more only contend with),
    OMP_NUM_THREADS where the user set it; a CPU rank its share of the machine's CPUs."""
    import os

    from specdp_cli import launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch.threads_per_rank("cuda", 1) == 1 and launch.threads_per_rank("cuda", 8) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.threads_per_rank("cuda", 1) == 3
    for bad in ("0", "four", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        assert launch.threads_per_rank("cuda", 1) == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert launch.threads_per_rank("cpu", 2) == 4 and launch.threads_per_rank("cpu", 16) == 1
