"""Async scheduling (`scheduler.async_scheduling`): the host plans step N + 1 before step N's tokens are read, the
device feeding each row the token the step before emitted (and, with an EAGLE head or an MTP layer, its drafts,
the rows moved back by the drafts verification rejected). On the CPU the forwards run as they are queued, so these
tests check the bookkeeping — tokens equal transformers' and the synchronous engine's, through chunked prefill,
sequences reaching M, the no-draft window, eos, seeded sampling, preemption, aborts and requests that need their
tokens first."""
import pytest
import torch

from engine_util import check_against_reference, eos_variant, make_config, make_engine, prompts_of_lengths, run_engine
from specdp_cli.runtime.sampling import SamplingParams

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]   # M = 64: the longest prompts reach M within a few tokens


def engine_for(models, on, **kw):
    cfg, plan = make_config(models["target"], method="none", M=kw.pop("M", 64), max_num_seqs=kw.pop("seqs", 4),
                            max_batched=kw.pop("batched", 24), scheduler={"async_scheduling": on}, **kw)
    assert plan.async_scheduling is on
    return make_engine(cfg, plan)


def test_greedy_equals_reference(models):
    engine = engine_for(models, True)
    prompts = prompts_of_lengths(LENGTHS)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(models["target"], done, prompts, 30, 64)
    c = engine.counters
    assert c.planned_ahead > c.steps // 2, (c.planned_ahead, c.steps)
    assert not engine.scheduler.running and all(s.pending == 0 for s in done.values())


def run_both(models, prompts, max_tokens, params=None, **kw):
    """The same requests through the engine with async scheduling off and on: ({index: Sequence} each, the async
    engine)."""
    out = []
    for on in (False, True):
        engine = engine_for(models, on, **kw)
        out.append(run_engine(engine, prompts, max_tokens=max_tokens, **dict(params or {})))
    return out[0], out[1], engine


def same(a: dict, b: dict) -> None:
    for i in a:
        assert (b[i].generated, b[i].finish_reason) == (a[i].generated, a[i].finish_reason), i


def test_eos_and_seeded_sampling_equal_the_synchronous_engine(models, tmp_path):
    """A sequence that stops on eos leaves a void row in the step already planned after it; seeded sampling draws
    the same tokens (its draws belong to the request and position, not to when the host learns them)."""
    prompts = prompts_of_lengths([6, 11, 19, 23, 8, 30], seed=4)
    tdir = eos_variant(models["target"], prompts, tmp_path / "t")
    sync, asyn, engine = run_both({**models, "target": tdir}, prompts, 20)
    same(sync, asyn)
    assert any(s.finish_reason == "stop" for s in asyn.values())
    sync, asyn, _ = run_both(models, prompts, 20, dict(temperature=0.9, top_p=0.95, top_k=50, seed=7))
    same(sync, asyn)


def test_preemption_through_async_scheduling(models):
    """A pool far smaller than the sequences need: a step that would preempt is planned only after the step on the
    device is read (nothing is preempted with a token pending); tokens equal the roomy synchronous run's."""
    prompts = prompts_of_lengths([5, 14, 23, 9, 30, 18, 11, 26], seed=7)
    roomy = run_engine(engine_for(models, False, seqs=6, batched=64), prompts, max_tokens=30)
    engine = engine_for(models, True, seqs=6, batched=64, cache={"block_size": 4, "num_blocks": 24})
    tight = run_engine(engine, prompts, max_tokens=30)
    assert engine.counters.preemptions > 0 and engine.counters.planned_ahead > 0
    assert engine.pool.num_free == 24
    same(roomy, tight)


def run_aborting(engine, prompts, max_tokens: int, at_step: int, req_id) -> tuple[dict, dict, list]:
    """Serve prompts, aborting request req_id before step at_step (a step then on the device, planned ahead): ({id:
    finished Sequence}, {id: Sequence of any output}, [(step, id) of every output])."""
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(i, p, SamplingParams(max_tokens=max_tokens), None))
    done, seqs, outputs, steps = {}, {}, [], 0
    while engine.has_work:
        steps += 1
        if steps == at_step:
            assert engine._inflight is not None and engine.abort(req_id)
        for out in engine.step():
            seqs[out.seq.req.id] = out.seq
            outputs.append((steps, out.seq.req.id))
            if out.finished:
                done[out.seq.req.id] = out.seq
    assert engine.step() is None
    return done, seqs, outputs


def test_abort_while_a_step_is_on_the_device(models):
    """A request aborted between steps, its next step already planned: that row is void, the others go on."""
    prompts = prompts_of_lengths([7, 12, 20], seed=9)
    ref = run_engine(engine_for(models, False), prompts, max_tokens=12)
    engine = engine_for(models, True)
    done, seqs, outputs = run_aborting(engine, prompts, 12, 4, 1)
    assert all(step < 4 or i != 1 for step, i in outputs)      # its row in the step on the device is void
    assert seqs[1].finish_reason == "abort" and seqs[1].pending == 0 and -1 not in seqs[1].tokens
    assert set(done) == {0, 2}
    for i in (0, 2):
        assert done[i].generated == ref[i].generated
    assert engine.pool.num_free == engine.pool.num_blocks


def test_requests_that_need_their_tokens_first(models):
    """Penalties, log-probabilities and a grammar read a sequence's tokens on the host: while one runs, each step
    waits for the last one's tokens; mixed with plain requests, every request's tokens equal the synchronous
    engine's."""
    import json
    prompts = prompts_of_lengths([6, 13, 21, 9], seed=3)
    fields = [{}, {"repetition_penalty": 1.3}, {"logprobs": 2}, {}]
    results = []
    for on in (False, True):
        engine = engine_for(models, on)
        for i, (p, f) in enumerate(zip(prompts, fields)):
            engine.add_request(engine.make_request(i, p, SamplingParams.from_dict({"max_tokens": 10, **f}), None))
        done = {}
        while engine.has_work:
            for out in engine.step():
                if out.finished:
                    done[out.seq.req.id] = out.seq
        results.append(done)
    same(*results)
    assert json.dumps(results[0][2].logprobs) == json.dumps(results[1][2].logprobs)


def test_preflight(models, heads):
    """On by default only where it pays (a GPU; here the CPU: off), refused with a drafter that drafts on the host
    (n-gram lookup) or tensor parallelism, named in the report; taken with an EAGLE head."""
    from specdp_cli.config import validate
    from specdp_cli.preflight import run_preflight
    base = {"model": str(models["target"]), "max_model_len": 64, "device": "cpu", "dtype": "float32"}
    report = run_preflight(validate({**base, "speculative": {"method": "none"}}))
    assert report.ok and report.to_json()["async_scheduling"] is False
    report = run_preflight(validate({**base, "speculative": {"method": "ngram", "num_speculative_tokens": 3},
                                     "scheduler": {"async_scheduling": True}}))
    assert not report.ok and any("scheduler.async_scheduling" in e and "ngram" in e for e in report.errors)
    report = run_preflight(validate({**base, "speculative": {"method": "eagle", "model": str(heads["eagle"][1]),
                                                             "num_speculative_tokens": 3},
                                     "scheduler": {"async_scheduling": True}}))
    assert report.ok and report.to_json()["async_scheduling"] is True
    report = run_preflight(validate({**base, "speculative": {"method": "none"}, "scheduler": {"async_scheduling": True},
                                     "parallel": {"tensor_parallel_size": 2}}))
    assert not report.ok and any("async_scheduling" in e and "tensor_parallel_size" in e for e in report.errors)
    # the default on a GPU: every method whose drafts need nothing from the host, a draft model among them
    from specdp_cli.plan import async_scheduling
    spec = {"draft_model": {"model": str(models["draft"])}, "mtp": {}, "ngram": {}}
    on = {m: async_scheduling(validate({**base, "speculative": {"method": m, "num_speculative_tokens": 3, **extra}}),
                              "cuda") for m, extra in spec.items()}
    assert on == {"draft_model": True, "mtp": True, "ngram": False}


@pytest.mark.timeout(300)
def test_lockstep_ranks_plan_ahead_alike(models, launches, tmp_path):
    """dp 2 in lockstep (every collective checked), async scheduling on, a long and a short request (one rank idles
    once its request is done): the tokens equal the synchronous dp 1 run's, both ranks run the same steps, and
    both planned ahead."""
    from dp_util import dp_config, generate_args, lockstep_run_equals_dp1, text_rows, write_jsonl
    inp = write_jsonl(tmp_path / "in.jsonl", text_rows(models["tokenizer"], [20, 4], [20, 9], seed=26))
    ref = dp_config(tmp_path, models["target"], None, dp=1, method="none", name="ref.yaml",
                    scheduler={"async_scheduling": False})
    cfg = dp_config(tmp_path, models["target"], None, dp=2, method="none", check=True,
                    scheduler={"async_scheduling": True})
    launches.start("lockstep", *generate_args(tmp_path, inp, cfg))
    ranks = lockstep_run_equals_dp1(tmp_path, inp, cfg, ref, launched=lambda: launches.result("lockstep"))
    assert len({r["steps"] for r in ranks}) == 1 and [r["requests"] for r in ranks] == [1, 1]
    assert all(r["planned_ahead"] > 0 for r in ranks)


def interpreted_feed_checks() -> None:
    """The CUDA path's two kernels (`triton_kernels.feed_rows` / `record_rows`) against the torch expressions the
    CPU runs (`async_rows`), under Triton's interpreter (test_kernels_interpreted.py runs it): rows that name a row
    of the step before (SRC = 1 + it), rows that do not, padding rows (zeros), drafts up to each row's NDRAFT, a
    draft model's catch-up only where the host staged one; with and without proposals and catch-ups."""
    from specdp_cli.runtime import async_rows
    from specdp_cli.runtime import triton_kernels as tk
    g = torch.Generator().manual_seed(0)
    R, width, kmax = 6, 24, 3
    cols = (0, 6, 12, 13, 14, 15, 16, 17, 18, 19)   # ids, drafter ids, START, FIRST, NDRAFT, SRC, DSTART, DNREAL, DOUT, LEN
    staged = torch.randint(0, 50, (R + 2, width), generator=g)
    staged[:R, 14] = torch.tensor([3, 0, 2, 1, 0, 3])
    staged[:R, 15] = torch.tensor([3, 0, 1, 6, 0, 2])          # 0: nothing to take
    staged[:R, 17] = torch.tensor([2, 0, 0, 2, 1, 2])          # no catch-up staged for row 2
    staged[R:] = 0

    def carry(proposes, catches):
        c = async_rows.Carry.allocate(8, kmax, proposes, catches, "cpu")
        for t in (c.last, c.drafts, c.catch_first, c.catch_count, c.catch_tokens):
            if t is not None:
                t.copy_(torch.randint(100, 200, t.shape, generator=g))
        c.short.copy_(-torch.randint(0, 4, (8,), generator=g))
        return c
    for proposes, catches in ((True, False), (False, True), (False, False)):
        c = carry(proposes, catches)
        want, got = staged.clone(), staged.clone()
        async_rows.feed(want, cols, c)
        tk.feed_rows(got, got.shape[0], cols, c)
        assert torch.equal(got, want), (proposes, catches, got, want)
    W, K = 4, 2
    table = torch.randint(0, 50, (5, W + 1 + K), generator=g)
    table[:, W] = torch.tensor([1, 4, 2, 1, 3])
    nd, first = staged[:5, 14], staged[:5, 13]                 # strided columns, as the staged rows'
    for proposes, catches in ((True, False), (False, True), (False, False)):
        want, got = async_rows.Carry.allocate(8, kmax, proposes, catches, "cpu"), \
            async_rows.Carry.allocate(8, kmax, proposes, catches, "cpu")
        async_rows.record(table, W, K, nd, first, want)
        tk.record_rows(table, W, K, nd, first, got)
        for a, b in zip(vars(got).values(), vars(want).values()):
            assert (a is None and b is None) or torch.equal(a, b), (a, b)
    assert torch.equal(want.last[:5], table[torch.arange(5), table[:, W] - 1])
    print("interpreted feed kernels: ok")


# -- drafting methods whose drafts stay on the device: an EAGLE head, an MTP layer ------------------------------

@pytest.fixture(scope="module")
def heads(tmp_path_factory, models):
    from helpers import make_deepseek_dir, make_eagle_head
    root = tmp_path_factory.mktemp("async_heads")
    return {"eagle": (models["target"], make_eagle_head(root / "head", models["target"])),
            "mtp": (make_deepseek_dir(root / "mtp", models["tokenizer"], seed=3), None),
            "draft_model": (models["target"], models["draft"])}


def drafting_engine(heads, method, on, D=None, **kw):
    target, head = heads[method]
    cfg, plan = make_config(target, head, method=method, k=3, M=64, D=D, max_num_seqs=kw.pop("seqs", 4),
                            max_batched=kw.pop("batched", 24), scheduler={"async_scheduling": on}, **kw)
    assert plan.async_scheduling is on
    return make_engine(cfg, plan)


@pytest.mark.parametrize("method,D", [("eagle", 40), ("mtp", None), ("draft_model", 40)])
def test_drafting_methods_plan_ahead(models, heads, method, D):
    """The host plans step N + 1 counting every draft of step N as accepted; the device moves the rows back by the
    rejected ones and feeds the proposals (or the draft model's catch-up tokens): greedy tokens equal target-only decoding (transformers) and the
    synchronous engine's, with the same drafts and acceptance — through chunked prefill, the no-draft window
    (D = 40: lengths 38..63) and sequences reaching M; seeded sampling draws the same tokens too."""
    prompts = prompts_of_lengths(LENGTHS, seed=6)
    runs = [drafting_engine(heads, method, on, D) for on in (False, True)]
    sync, asyn = (run_engine(e, prompts, max_tokens=30) for e in runs)
    same(sync, asyn)
    check_against_reference(heads[method][0], asyn, prompts, 30, 64, *(("lora",) if method == "mtp" else ()))
    for i in sync:
        assert vars(asyn[i].stats) == vars(sync[i].stats), i
    c = runs[1].counters
    assert c.spec.num_drafts > 0 and c.spec.num_accepted_tokens < c.spec.num_draft_tokens    # some rejected
    assert c.planned_ahead > c.steps // 2, (c.planned_ahead, c.steps)
    assert all(s.pending == 0 and s.unsure == 0 for s in asyn.values())
    params = dict(temperature=0.9, top_p=0.95, top_k=50, seed=7)
    same(*(run_engine(drafting_engine(heads, method, on, D), prompts, max_tokens=20, **params) for on in (False, True)))


def test_a_sequence_near_its_limit_is_planned_ahead_with_the_drafts_of_its_shortest_length(models, heads):
    """Near max_tokens a sequence's drafts this step depend on how many the step on the device accepts. A greedy
    request's next row is planned anyway, with the drafts of its shortest possible length: verification's tokens
    past its limit are cut, and the books count the contract's k_eff at its true length — tokens, drafts and
    acceptance stay the synchronous engine's, and the batch does not wait for the host. A sampled request sits the
    next step out instead (its draws depend on where drafts stand), again as the synchronous engine decodes it."""
    prompts = prompts_of_lengths([4, 7, 10, 13, 16, 19, 22, 25], seed=8)
    limits = [12 + 4 * i for i in range(8)]      # limits apart: some sequence is near its limit most of the time
    for params in ({}, dict(temperature=0.9, top_p=0.95, top_k=50, seed=7)):
        runs = [drafting_engine(heads, "draft_model", on, seqs=8, batched=64) for on in (False, True)]
        sync, asyn = (run_engine(e, prompts, max_tokens=limits, **params) for e in runs)
        same(sync, asyn)
        for i in sync:
            assert vars(asyn[i].stats) == vars(sync[i].stats), i
        c = runs[1].counters
        assert c.steps == runs[0].counters.steps
        if not params:
            # (with those sequences sitting a step out instead, 26 of these 41 steps were planned ahead)
            assert c.planned_ahead >= 0.85 * c.steps, (c.planned_ahead, c.steps)
        else:
            assert c.steps // 3 < c.planned_ahead < 0.85 * c.steps, (c.planned_ahead, c.steps)


def test_eagle_preemption_and_abort_while_planned_ahead(models, heads):
    """A tight pool (steps that would preempt wait for the step on the device) and an abort between steps: every
    other request's tokens equal the roomy synchronous run's; the pool ends whole."""
    prompts = prompts_of_lengths([5, 14, 23, 9, 30, 18, 11, 26], seed=7)
    roomy = run_engine(drafting_engine(heads, "eagle", False, seqs=6, batched=64), prompts, max_tokens=30)
    engine = drafting_engine(heads, "eagle", True, seqs=6, batched=64, cache={"block_size": 4, "num_blocks": 30})
    done, seqs, _ = run_aborting(engine, prompts, 30, 6, 3)
    assert engine.counters.preemptions > 0 and engine.counters.planned_ahead > 0
    assert seqs[3].finish_reason == "abort" and seqs[3].pending == 0 and -1 not in seqs[3].tokens
    same({i: s for i, s in roomy.items() if i != 3}, {i: s for i, s in done.items() if i != 3})
    assert engine.pool.num_free == 30
