"""The step's k (spec_length.py) on one rank: greedy float32 output equals target-only output whatever
the schedule (fixed ranges, adaptive, k toggling to 0 and back: the drafter catches up, also past a
chunk's width), the per-request opt-out is lossless and its sequence drafts nothing, and the
configuration refuses bad schedules with a sentence."""
import pytest

from engine_util import check_against_reference, hf_reference, make_config, make_engine, prompts_of_lengths, run_engine
from helpers import make_eagle_head
from specdp_cli.config import ConfigError, validate
from specdp_cli.runtime.sampling import SamplingParams
from specdp_cli.runtime.spec_length import TEST_ENV, SpecLength

LENGTHS = [3, 9, 17, 26, 33, 41]
M = 64


def check(target, done, prompts, max_tokens):
    check_against_reference(target, done, prompts, max_tokens, M)


def run(models, monkeypatch, forced=None, draft=None, method="draft_model", max_tokens=30, **spec):
    if forced is not None:
        monkeypatch.setenv(TEST_ENV, f"0:{forced}")
    cfg, plan = make_config(models["target"], draft or models["draft"], method=method, k=3, M=M, max_num_seqs=4,
                            max_batched=64, speculative={"prompt_lookup_min": 1, "prompt_lookup_max": 3, **spec})
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=3)
    done = run_engine(engine, prompts, max_tokens=max_tokens)
    return engine, done, prompts


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_ranges_are_lossless_and_counted(models, monkeypatch, method):
    engine, done, prompts = run(models, monkeypatch, method=method,
                                num_speculative_tokens_per_batch_size=[[1, 2, 1], [3, 4, 0]])
    check(models["target"], done, prompts, 30)
    used = engine.spec_len.used
    assert used[0] and used[1], used                      # 3-4 running: k 0, 1-2: k 1
    assert sum(used.values()) == engine.counters.steps


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_adaptive_is_lossless_and_reports_its_model(models, monkeypatch, tmp_path, method):
    draft = make_eagle_head(tmp_path / "head", models["target"]) if method == "eagle" else None
    engine, done, prompts = run(models, monkeypatch, adaptive=True, method=method, draft=draft)
    check(models["target"], done, prompts, 30)
    rep = engine.spec_len.report()
    assert rep["mode"] == "adaptive" and rep["k_values"] == [0, 1, 2, 3]
    assert [m["k"] for m in rep["model"]] == [0, 1, 2, 3]
    assert all(m["step_ms"] > 0 and m["tokens_per_step"] >= 1 for m in rep["model"])
    assert all(cost > 0 for cost in engine.spec_len.drafter_cost.values()) and engine.spec_len.drafter_cost


def test_k_toggling_to_zero_and_back_catches_the_drafter_up(models, monkeypatch, tmp_path):
    """A drafter identical to the target accepts every draft only if its cache holds every token:
    after long runs of k = 0 (more missed tokens than a row's width) it must catch up exactly."""
    import shutil
    copy = shutil.copytree(models["target"], tmp_path / "copy")
    forced = ",".join(["3", "0", "0", "2"] + ["0"] * 20 + ["3", "1"])
    engine, done, prompts = run(models, monkeypatch, forced=forced, draft=copy, max_tokens=40)
    check(models["target"], done, prompts, 40)
    s = engine.counters.spec
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
    assert engine.spec_len.used[0] > 20 and engine.spec_len.used[3]


def test_adaptive_choice_is_worked_out_while_a_step_runs_and_used_two_steps_on(models, monkeypatch):
    """The adaptive k's host work runs in the time the device runs a step: the preference worked out
    during step s has seen the measurements of steps up to s - 1, rides in step s + 1's sync and is the
    k of step s + 2. Forced preferences show the order; spies show what each choice had seen."""
    forced = [1, 0, 2, 3, 0, 1]
    monkeypatch.setenv(TEST_ENV, "0:" + ",".join(map(str, forced)))
    cfg, plan = make_config(models["target"], models["draft"], k=3, M=M, max_num_seqs=4, max_batched=64,
                            speculative={"adaptive": True})
    engine = make_engine(cfg, plan)
    sl = engine.spec_len
    events = []
    observe_rows, preferred = sl.observe_rows, sl.preferred

    def spy_observe(verified):
        events.append(("observe", engine.step_no))
        observe_rows(verified)

    def spy_preferred(*args):
        events.append(("choose", engine.step_no))
        return preferred(*args)
    monkeypatch.setattr(sl, "observe_rows", spy_observe)
    monkeypatch.setattr(sl, "preferred", spy_preferred)
    step_ks = []
    step = engine.step

    def recording_step(*args, **kwargs):
        outputs = step(*args, **kwargs)
        step_ks.append(engine.scheduler.k_step)
        return outputs
    monkeypatch.setattr(engine, "step", recording_step)
    prompts = prompts_of_lengths(LENGTHS, seed=3)
    done = run_engine(engine, prompts, max_tokens=20)
    check(models["target"], done, prompts, 20)
    n = len(step_ks)
    assert n > 10
    # steps 1 and 2 run the configured k; step s >= 3 the preference worked out during step s - 2
    assert step_ks == [3, 3] + [forced[(s - 3) % len(forced)] for s in range(3, n + 1)]
    # during step s: step s - 1's measurements first, then the choice (once a step, every step)
    assert [e for e in events if e[0] == "choose"] == [("choose", s) for s in range(1, n + 1)]
    assert events[:2] == [("choose", 1), ("observe", 2)] and events[2] == ("choose", 2)
    assert all(events[i + 1] == ("choose", s) for i, (what, s) in enumerate(events) if what == "observe")


def test_eagle_with_k_toggling_is_lossless(models, monkeypatch, tmp_path):
    head = make_eagle_head(tmp_path / "head", models["target"])
    engine, done, prompts = run(models, monkeypatch, forced="3,0,0,1,0,3,2", draft=head, method="eagle")
    check(models["target"], done, prompts, 30)
    assert engine.counters.spec.num_drafts > 0 and engine.spec_len.used[0]


def test_opt_out_is_lossless_and_drafts_nothing(models):
    cfg, plan = make_config(models["target"], models["draft"], k=3, M=M, max_num_seqs=4)
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(i, p, SamplingParams(max_tokens=20, speculative=i % 2 == 0), None))
    done = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                done[out.seq.req.id] = out.seq
    check(models["target"], done, prompts, 20)
    assert all(done[i].stats.num_drafts == 0 for i in done if i % 2)
    assert all(done[i].stats.num_drafts > 0 for i in done if i % 2 == 0)


def test_agreement_rule_takes_the_largest_batch():
    assert SpecLength.agree([3, 7, 7], [1, 4, 0]) == 4       # ties: the lower rank
    assert SpecLength.agree([0, 0], [2, 3]) == 2
    s = SpecLength(4, [[1, 4, 3], [5, 16, 1], [17, 64, 0]], False)
    assert [s.for_batch(n) for n in (0, 1, 4, 5, 16, 17, 64, 65)] == [4, 3, 3, 1, 1, 0, 0, 4]
    assert s.k_values == [0, 1, 3, 4]


@pytest.mark.parametrize("spec,needle", [
    ({"num_speculative_tokens_per_batch_size": [[1, 4, 5]]}, "k must lie in 0..num_speculative_tokens (4)"),
    ({"num_speculative_tokens_per_batch_size": [[1, 8, 2], [8, 16, 1]]}, "overlap"),
    ({"num_speculative_tokens_per_batch_size": [[1, 8]]}, "[start, end, k]"),
    ({"num_speculative_tokens_per_batch_size": [[5, 2, 1]]}, "1 <= start <= end"),
    ({"num_speculative_tokens_per_batch_size": [[1, 8, 2]], "adaptive": True}, "not both"),
])
def test_bad_schedules_are_refused(spec, needle):
    with pytest.raises(ConfigError) as e:
        validate({"model": "m", "speculative": {"num_speculative_tokens": 4, **spec}})
    assert needle in str(e.value)


def test_opt_out_field_is_checked():
    from specdp_cli.request_params import ParamError, check_sampling
    assert check_sampling({"speculative": False}, {"max_tokens": 4})["speculative"] is False
    assert "speculative" not in check_sampling({"speculative": True}, {"max_tokens": 4})
    with pytest.raises(ParamError, match="true or false"):
        check_sampling({"speculative": "no"}, {"max_tokens": 4})


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "eagle"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_every_k_has_whole_step_kinds(models, tmp_path, method, adaptive):
    """The step kinds a GPU captures whole (one CUDA graph per kind and row count): a decode step and a
    step with prompt chunks at every k the schedule can choose (with continuous batching, prompt chunks
    ride in a large share of the steps: a k without its chunk kind ran its forwards one by one)."""
    draft = make_eagle_head(tmp_path / "head", models["target"]) if method == "eagle" else models["draft"]
    cfg, plan = make_config(models["target"], draft, method=method, k=3, M=M, max_num_seqs=4, max_batched=64,
                            speculative={"prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                         **({"adaptive": True} if adaptive else {})})
    engine = make_engine(cfg, plan)
    kinds = [sz for _, sz, _ in engine._step_kinds()]
    ks = [0] if method == "none" else [0, 1, 2, 3] if adaptive else [3]
    if engine.drafter.has_forward:
        assert {sz.K for sz in kinds if sz.T == sz.T_dec} == set(ks)
        assert {sz.K for sz in kinds if sz.T == engine.T_chunk} >= set(ks)
    else:       # no drafter forward: a step verifies a window of drafts or none
        windows = {1} | {k + 1 for k in ks}
        assert {sz.T_dec for sz in kinds if sz.T == sz.T_dec} == windows
        assert {sz.T_dec for sz in kinds if sz.T == engine.T_chunk} == windows


def test_adaptive_prices_unmeasured_k_from_the_measured_ones():
    s = SpecLength(6, None, True)
    s.target_cost = {(8, 1): 1.0, (8, 7): 7.0}          # start-up timings: 1 s a token per row (pessimistic)
    for k in (0, 1, 2):
        s.observe_step(8, k, 9.0)                      # a kind's first step pays one-time costs: left out
        s.observe_step(8, k, 1 + 0.1 * k)              # measured decode steps: 1 + 0.1 k
    assert abs(s.cost(5, 8) - 1.5) < 1e-9               # the line through them, not the start-up timings
    for _ in range(100):
        s.observe_step(8, 2, 3.0, chunks=True)          # steps with prompt chunks, measured at k = 2 only
    share = s.chunk_share
    assert 0.9 < share < 1
    # a chunk step at k = 5: the measured one at k = 2 plus the decode costs' difference
    assert abs(s.cost(5, 8) - ((1 - share) * 1.5 + share * (3.0 + 1.5 - 1.2))) < 1e-9
    s.reset_measurements()
    assert s.chunk_share == 0 and not s.chunk_extra and abs(s.cost(5, 8) - 6.0) < 1e-9


def test_adaptive_explores_a_neighbour_and_climbs_to_the_best_k():
    """Start-up timings that overprice k make k = 0 look best; every 16th choice tries a neighbour, and
    once a second k is measured the line through the measured costs prices every k truly."""
    s = SpecLength(6, None, True)
    s.target_cost = {(8, 1): 1.0, (8, 7): 7.0}
    true_cost = {k: 1 + 0.1 * k for k in range(7)}
    # expected tokens at the prior acceptance 0.6 over the true cost: k = 3 is best
    best = max(range(7), key=lambda k: s.tokens(k) / true_cost[k])
    assert best == 3
    choices = []
    for _ in range(64):
        k = s.preferred(8, 8)
        choices.append(k)
        s.observe_step(8, k, true_cost[k])
    assert choices[0] == 0 and choices[15] == 1          # the 16th choice explores k = 1
    assert choices[31] == 1                               # again: its first step was left out (one-time costs)
    assert choices[33:47] == [best] * 14
    assert choices[47] in (best - 1, best + 1) and choices[63] in (best - 1, best + 1)


def test_adaptive_one_stalled_step_does_not_price_a_k_out():
    """A step that stalls (the OS, a garbage collection, a rank waiting on another in lockstep) costs its
    k at most twice what the measurements expect (four times a guess), and the first measurements are
    averaged, not kept with 90 % weight: one stall on the first measured step at k = 2 must not keep
    the choice from staying at the best k."""
    s = SpecLength(6, None, True)
    s.target_cost = {(8, 1): 1.0, (8, 7): 7.0}
    true_cost = {k: 1 + 0.1 * k for k in range(7)}
    best = max(range(7), key=lambda k: s.tokens(k) / true_cost[k])
    at_k2 = 0
    choices = []
    for _ in range(128):
        k = s.preferred(8, 8)
        choices.append(k)
        at_k2 += k == 2
        stall = 50.0 if k == 2 and at_k2 == 2 else 0.0   # the first step of a kind is left out; the next stalls
        s.observe_step(8, k, true_cost[k] + stall)
    assert choices.count(2) >= 3
    assert s.measured[(8, 2)] < 4 * true_cost[2]          # a first measurement: held to 4 x its guess
    assert choices[-16:].count(best) >= 12, choices


def test_adaptive_a_drift_of_every_step_does_not_price_the_other_ks():
    """Every step time drifts together (the host, clocks, the other rank in lockstep), but only the chosen
    k is measured while it lasts: measured relative to the running level, the other k's costs move
    with it, and the two k's keep their true ratio within 10 % (raw times: the chosen k 1.5 x dearer)."""
    s = SpecLength(6, None, True)
    s.target_cost = {(8, 1): 1.0, (8, 7): 7.0}
    true_cost = {k: 1 + 0.1 * k for k in range(7)}
    for _ in range(20):
        for k in (2, 3):
            s.observe_step(8, k, true_cost[k])
    for _ in range(60):
        s.observe_step(8, 3, 1.5 * true_cost[3])        # everything 1.5 x slower; only k = 3 runs
    assert s.level > 1.3
    assert abs(s.cost(2, 8) / s.cost(3, 8) / (true_cost[2] / true_cost[3]) - 1) < 0.1


def test_adaptive_a_guess_too_low_is_not_a_trap():
    """Two noisy measurements (k = 2 at 1.0, k = 3 at 2.0, truly 1.2 and 1.3) send the line through them
    to ~0 at k = 0 and 1. Those k get chosen; their true cost must then count (a first measurement is
    held only loosely to a guess, and guesses go no lower than half the cheapest measured step), so the
    choice comes back to what is truly within a few per cent of the best k."""
    s = SpecLength(6, None, True)
    s.target_cost = {(32, 1): 1.0, (32, 7): 7.0}
    for k, t in ((2, 1.0), (3, 2.0)):
        s.observe_step(32, k, 9.0)          # a kind's first step: left out
        s.observe_step(32, k, t)
    true_cost = {k: 1 + 0.1 * k for k in range(7)}
    rate = {k: s.tokens(k) / true_cost[k] for k in range(7)}     # the prior acceptance stays put (no rows)
    choices = []
    for _ in range(128):
        k = s.preferred(32, 32)
        choices.append(k)
        s.observe_step(32, k, true_cost[k])
    achieved = sum(rate[k] for k in choices[-64:]) / 64
    assert achieved >= 0.95 * max(rate.values()), choices
    assert 0.5 < s.level < 2


def test_adaptive_prices_new_batch_sizes_by_the_measured_shape_in_k():
    """The batch drains at the end of a job: at a batch size never measured, k is priced by the shape of
    the nearest batch size's measured steps (moved by the start-up timings' ratio between the two), not
    by the start-up timings alone, which overprice k (here 6 x): the choice stays where the measurements
    put it."""
    s = SpecLength(6, None, True)
    s.target_cost = {(8, 1): 1.0, (8, 7): 7.0, (32, 1): 2.0, (32, 7): 14.0}
    true_cost = {k: 1 + 0.02 * k for k in range(7)}       # host-bound steps: k costs little
    for k in (1, 2, 3, 4):
        s.observe_step(32, k, 9.0)                       # a kind's first step: left out
        s.observe_step(32, k, true_cost[k])
    best = max(range(7), key=lambda k: (s.tokens(k) / true_cost[k], -k))
    assert best == 6
    assert s.preferred(32, 32) == best
    assert s.preferred(8, 8) == best                     # the start-up timings alone would choose k = 0
    s.observe_step(8, 6, 9.0)
    s.observe_step(8, 6, 0.5)                            # one k measured at 8 rows: the shape scaled to it
    assert abs(s.cost(6, 8) - 0.5) < 1e-9 and abs(s.cost(2, 8) / s.cost(6, 8) - true_cost[2] / true_cost[6]) < 1e-9


def test_adaptive_chunk_steps_price_no_k_by_the_prompts_they_happened_to_carry():
    """What prompt chunks add to a step depends on how many prompt rows it carries (heavy at the start of
    a job), not on k: one average over every chunk step, whatever its k. Pricing each k's chunk steps
    separately made the k first seen in heavy ones look dear for the rest of the job."""
    s = SpecLength(6, None, True)
    s.target_cost = {(16, 1): 6.0, (16, 7): 6.3}
    decode = {k: 6.0 + 0.05 * k for k in range(7)}
    best = max(range(7), key=lambda k: (s.tokens(k) / decode[k], -k))
    assert best == 6
    choices = []
    for i in range(200):
        k = s.preferred(16, 16)
        choices.append(k)
        chunks = i % 3 == 0
        extra = (10.0 if i < 30 else 4.0) if chunks else 0.0     # the first prompts arrive all at once
        s.observe_step(16, k, decode[k] + extra, chunks=chunks)
    assert choices[-64:].count(best) >= 56, choices


def test_adaptive_a_new_k_learns_its_cost_instead_of_moving_the_level():
    """The choice moves to a k whose price was a guess (the line through k = 2..5) and which truly costs
    more (a cliff at k = 6). Its steps must price it, not the running level: the level absorbing the
    guess's error would make every other k look dearer by as much, and the choice would stay."""
    s = SpecLength(6, None, True)
    s.target_cost = {(16, 1): 1.0, (16, 7): 1.06}
    true_cost = {k: 1.0 + 0.01 * k for k in range(6)} | {6: 1.4}
    for _ in range(12):
        for k in (2, 3, 4, 5):
            s.observe_step(16, k, true_cost[k])
    best = max(range(7), key=lambda k: (s.tokens(k) / true_cost[k], -k))
    assert best == 5 and s.preferred(16, 16) == 6          # the line prices k = 6 at 1.06
    choices = []
    for _ in range(128):
        k = s.preferred(16, 16)
        choices.append(k)
        s.observe_step(16, k, true_cost[k])
    assert choices[-32:].count(best) >= 28, choices
    assert 0.9 < s.level < 1.1


def test_adaptive_draining_batch_plans_for_the_row_that_finishes_last():
    """When an offline job has nothing left to admit, it ends with the row that needs the most steps; the
    rows left are mostly those whose drafts are rarely accepted, where a large k costs every step and
    gains little. The drain choice minimises step cost x the steps the slowest row needs; the rows' own
    acceptance counts, mixed with the pooled rate."""
    s = SpecLength(6, None, True)
    s.target_cost = {(8, 1): 1.0, (8, 7): 1.3}
    for _ in range(50):
        s.observe_rows([(6, 6)] * 6 + [(6, 1)] * 2)        # pooled: most rows accept everything
    true_cost = {k: 1.0 + 0.1 * k for k in range(7)}
    for k in range(7):
        s.observe_step(8, k, 9.0)
        s.observe_step(8, k, true_cost[k])
    assert s.preferred(8, 8) == 6                             # the pooled objective: the longest drafts
    fast = [(60, 60, 55, True)] * 4                            # rows like the pool
    slow = [(60, 60, 6, True)]                                # one accepts a tenth of its drafts
    s._best = None
    assert s.preferred(8, 8, lambda: fast) == 6
    s._best = None
    assert s.preferred(8, 8, lambda: fast + slow) <= 2
    s._best = None
    assert s.preferred(8, 8, lambda: fast + [(1, 60, 6, True)]) == 6   # a slow row with one token left: no matter
    s._best = None
    # a request that opted out, with the most tokens left: it gains a token a step whatever k is, so the
    # drain ends with it, and the cheapest step (k = 0) finishes soonest; with fewer left than the others
    # need at k = 6, it does not count
    assert s.preferred(8, 8, lambda: fast + [(200, 0, 0, False)]) == 0
    s._best = None
    assert s.preferred(8, 8, lambda: fast + [(5, 0, 0, False)]) == 6


def test_generate_plans_for_the_drain_only_once_every_input_is_handed_over(models, tmp_path):
    """generate adds inputs as slots free, so the scheduler's queue is empty all along: the engine learns
    from the job whether more inputs are coming. The drain choice gets the running rows only once the
    job's pool is empty; the output stays the target's."""
    from specdp_cli.jobs.generate import serve_requests
    from specdp_cli.jobs.inputs import JobRequest
    from specdp_cli.jobs.results import PartWriter
    from specdp_cli.jobs.work_pool import WorkPool
    from specdp_cli.runtime.dist import DPGroup

    cfg, plan = make_config(models["target"], models["draft"], k=3, M=M, max_num_seqs=2, max_batched=64,
                            speculative={"adaptive": True})
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=5)
    params = {"max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop": []}
    pool = WorkPool([JobRequest(i, i, p, params) for i, p in enumerate(prompts)])
    seen = []
    preferred = engine.spec_len.preferred

    def spy(n, rows, rows_left=None):
        seen.append((rows_left is not None, pool.empty))
        return preferred(n, rows, rows_left)
    engine.spec_len.preferred = spy
    writer = PartWriter(str(tmp_path / "part"))
    records = serve_requests(engine, DPGroup.solo(), pool, writer)
    writer.close()
    assert all(given == empty for given, empty in seen)
    assert any(given for given, _ in seen) and not all(given for given, _ in seen)
    done = {r["id"]: r["token_ids"] for r in records}
    for i, p in enumerate(prompts):
        assert done[i] == hf_reference(models["target"], p, min(12, M - len(p))), i
