"""Never loops: a sequence near max_model_len gains tokens or ends, whatever the drafter, k schedule and
KV cache size — the EAGLE livelock (a look-ahead counted past M asked a minimal cache for a block it does
not have; the sequence preempted itself and was recomputed forever) is gone — and the progress guard
turns any livelock into an error that names the sequences: `generate` fails with exit 1 and keeps the
finished results (dp 1, and dp 2 in lockstep, where every rank stops at the same step), `serve` answers
the stalled request with a 500 and goes on serving."""
import json

import pytest
from typer.testing import CliRunner

from dp_util import HARD_TIMEOUT_S, dp_config, selected, write_jsonl
from engine_util import check_against_reference, make_config, make_engine, prompts_of_lengths, run_engine
from helpers import make_eagle_head
from specdp_cli.cli import app
from specdp_cli.runtime.kv_cache import BlockPool
from specdp_cli.runtime.progress import ProgressGuard
from specdp_cli.runtime.sampling import SamplingParams
from specdp_cli.runtime.scheduler import Request, Scheduler
from test_serve import free_port, server_config, start_server_ahead

@pytest.fixture(scope="module")
def head(tmp_path_factory, models):
    return make_eagle_head(tmp_path_factory.mktemp("progress") / "head", models["target"])


@pytest.mark.parametrize("method,k,M,extra", [
    ("eagle", 4, 304, {}), ("eagle", 6, 304, {}), ("eagle", 3, 61, {}),      # the report: M 304, a 299-token prompt
    ("eagle", 6, 304, {"speculative": {"adaptive": True}}),
    ("draft_model", 4, 304, {}), ("draft_model", 6, 61, {})])
def test_one_sequence_near_M_with_a_minimal_cache_ends_and_equals_the_target(models, head, method, k, M, extra):
    """max_num_seqs 1, so the CPU cache holds exactly one full-length sequence: prompts M - 1 ... M - k - 2
    each run alone to M, in chunks of 16 prompt tokens (prefill takes many steps, the guard must not fire)."""
    drafter = head if method == "eagle" else models["draft"]
    cfg, plan = make_config(models["target"], drafter, method=method, k=k, M=M, max_num_seqs=1, max_batched=16, **extra)
    engine = make_engine(cfg, plan)
    assert engine.pool.num_blocks == -(-M // cfg.cache.block_size)
    prompts = prompts_of_lengths([M - d for d in range(1, k + 3)], seed=k)
    done = run_engine(engine, prompts, max_tokens=64)
    check_against_reference(models["target"], done, prompts, 64, M, label=f"{method} k={k} M={M}")
    assert all(s.finish_reason == "length" and s.L == M for s in done.values())


def test_no_step_ever_needs_more_blocks_than_a_full_length_sequence():
    """The one reservation rule (`Scheduler.kv_positions`) over every length, k, look-ahead and max_tokens:
    never more blocks than max_model_len tokens take, so a sequence alone in a minimal cache always runs."""
    M, bs = 61, 4
    for k in range(1, 8):
        for lookahead in (0, k - 1):
            sched = Scheduler(BlockPool(-(-M // bs), bs), 1, 64, k, M, M, lookahead=lookahead)
            for P in range(1, M):
                for max_tokens in (1, 2, k, 64):
                    sched.add(Request(0, list(range(P)), SamplingParams(max_tokens=max_tokens)))
                    seq = sched.waiting.pop()
                    assert sched.pool.blocks_for(sched.kv_positions(seq)) <= sched.pool.num_blocks      # prefill
                    seq.target_len = seq.prefill_len
                    while seq.L < seq.limit:                      # decoding, one token a step
                        assert sched.pool.blocks_for(sched.kv_positions(seq)) <= sched.pool.num_blocks, (k, P, seq.L)
                        seq.tokens.append(2)
                        seq.target_len = seq.L - 1


def test_the_guard_allows_the_longest_prefill_and_fires_after_it():
    g = ProgressGuard(prefill_steps=19)
    assert not any(g.after_step(held=True, progressed=False) for _ in range(2 * 20))
    assert not g.after_step(held=False, progressed=False)           # an idle rank (lockstep padding) resets it
    fired = [g.after_step(held=True, progressed=False) for _ in range(g.limit)]
    assert fired[-1] and not any(fired[:-1])


def test_generate_stalled_job_fails_and_keeps_finished_results(tmp_path, models, monkeypatch):
    """dp 1 (in this process): exit 1, a sentence naming the frozen request, the others' results on disk."""
    cfg = dp_config(tmp_path, models["target"], models["draft"], dp=1)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "def add(a, b):" * (i + 1)} for i in range(4)])
    out = tmp_path / "out.jsonl"
    monkeypatch.setenv("SPECDP_FAULT", "freeze:0:2")
    res = CliRunner().invoke(app, ["generate", str(cfg), "--input", str(inp), "--output", str(out)])
    assert res.exit_code == 1, res.output
    assert "no progress on rank 0" in res.output and "request 'r1'" in res.output and "decode" in res.output
    kept = [json.loads(x)["id"] for x in open(f"{out}.rank0.part")]
    assert sorted(kept) == ["r0", "r2", "r3"]
    assert "Traceback" not in res.output


@pytest.fixture(scope="module", autouse=True)
def stalled_job(request, tmp_path_factory, models, launches):
    """The lockstep test's command (rank 1's second request frozen) and the server test's server (rank 0's second
    request frozen), started when this module starts, while the in-process tests run."""
    if selected(request, "test_serve_stalled_request_gets_500_and_the_server_goes_on"):
        port = free_port()
        cfg = server_config(tmp_path_factory.mktemp("stalled_serve"), models, port)
        start_server_ahead(request, launches, "server", cfg, port, SPECDP_FAULT="freeze:0:2")
    if not selected(request, "test_generate_stalled_rank_stops_every_lockstep_rank"):
        return None
    tmp = tmp_path_factory.mktemp("stalled_job")
    cfg = dp_config(tmp, models["target"], models["draft"], dp=2, dp_sync="always", max_num_seqs=2)
    inp = write_jsonl(tmp / "in.jsonl", [{"id": i, "prompt": "for i in range(10):" * (i + 1)} for i in range(6)])
    launches.start("stalled", "generate", cfg, "--input", inp, "--output", tmp / "out.jsonl",
                   env={"SPECDP_FAULT": "freeze:1:2"}, exclusive=True)      # the test bounds its wall time
    return tmp


@pytest.mark.timeout(HARD_TIMEOUT_S + 30)
def test_generate_stalled_rank_stops_every_lockstep_rank(stalled_job, launches):
    r, secs = launches.result("stalled")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "job failed: no progress on rank 1 for" in r.stderr and "KV blocks held" in r.stderr, r.stderr[-3000:]
    kept = [json.loads(x)["id"] for p in stalled_job.glob("out.jsonl.rank*.part") for x in open(p)]
    assert len(kept) == 5                  # every request but the frozen one finished, and is kept
    assert secs < 60


@pytest.mark.timeout(300)
def test_serve_stalled_request_gets_500_and_the_server_goes_on(launches):
    """dp 2 in lockstep: rank 0's second request stalls (one request at a time goes to rank 0, the least
    loaded); it gets an OpenAI 500 naming it, the server stays healthy and serves the next one alike."""
    s = launches.result("server")
    try:
        body = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}
        answers = [s.http("POST", "/v1/completions", body) for _ in range(3)]
        assert [a[0] for a in answers] == [200, 500, 200], [a[1][:300] for a in answers]
        err = json.loads(answers[1][1])["error"]
        assert err["type"] == "server_error" and "no progress on rank 0" in err["message"], err
        assert "decode" in err["message"] and "KV blocks held" in err["message"]
        assert json.loads(answers[2][1])["choices"][0]["text"] == json.loads(answers[0][1])["choices"][0]["text"]
        assert s.health() == 200 and s.proc.poll() is None
    finally:
        s.stop()
