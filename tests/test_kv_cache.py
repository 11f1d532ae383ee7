"""The paged KV cache: attention over block tables (padded and unpadded batches, uniform and mixed
forwards, scattered blocks) against transformers' own forward; admission by free blocks; and jobs
that run out of blocks finishing through preemption with the outputs of a roomy run."""
import pytest
import torch

from engine_util import make_config, make_engine, prompts_of_lengths, run_engine
from specdp_cli.runtime.kv_cache import BlockPool, allocate_kv
from specdp_cli.runtime.models.loader import load_model
from specdp_cli.runtime.model_runner import ModelRunner
from specdp_cli.runtime.sampling import SamplingParams
from specdp_cli.runtime.scheduler import Request, Scheduler


def test_block_pool():
    pool = BlockPool(5, 4)
    a = pool.allocate(3)
    assert a == [1, 2, 3] and pool.num_free == 2          # block 0 is the trash block, never handed out
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    pool.free(a)
    assert pool.num_free == 5 and pool.blocks_for(9) == 3


def test_admission_waits_for_free_blocks():
    pool = BlockPool(10, 4)
    sched = Scheduler(pool, max_num_seqs=8, max_batched_tokens=1000, k=0, max_model_len=64, D=64)
    for i in range(4):
        sched.add(Request(i, list(range(2, 14)), SamplingParams(max_tokens=8)))     # 12 tokens = 3 blocks
    plan = sched.schedule()
    assert [s.req.id for s, _, _ in plan.prefill] == [0, 1, 2]                       # 9 of 10 blocks taken
    assert len(sched.waiting) == 1 and pool.num_free == 1
    sched.remove(sched.running[0])
    sched.schedule()
    assert [s.req.id for s in sched.running] == [1, 2, 3] and not sched.waiting
    # max_num_seqs bounds admission too
    sched2 = Scheduler(BlockPool(100, 4), max_num_seqs=2, max_batched_tokens=1000, k=0, max_model_len=64, D=64)
    for i in range(3):
        sched2.add(Request(i, [5, 6, 7], SamplingParams(max_tokens=8)))
    sched2.schedule()
    assert len(sched2.running) == 2 and len(sched2.waiting) == 1


def test_decode_growth_preempts_the_newest():
    pool = BlockPool(6, 4)
    sched = Scheduler(pool, max_num_seqs=8, max_batched_tokens=1000, k=2, max_model_len=64, D=64)
    for i in range(3):
        sched.add(Request(i, list(range(2, 10)), SamplingParams(max_tokens=20)))     # 8 tokens = 2 blocks each
    sched.schedule()
    for s in sched.running:                        # pretend the prompts were prefilled and a token drawn
        s.target_len = s.prefill_len
        s.tokens.append(7)
    plan = sched.schedule()                        # each needs blocks_for(9 + 2) = 3: only 6 blocks in all
    assert plan.preempted == 1 and [s.req.id for s in sched.running] == [0, 1]
    victim = sched.waiting[0]
    assert victim.req.id == 2 and victim.preemptions == 1 and victim.blocks == []
    assert victim.L == 9 and victim.prefill_len == 8 and victim.target_len == 0    # recomputed later, tokens kept
    assert sorted(b for s in sched.running for b in s.blocks) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("method", ["draft_model", "ngram", "none"])
def test_job_beyond_num_blocks_completes_through_preemption(models, method):
    """Sequences that together need far more blocks than the pool has: the same greedy tokens as a
    roomy run, through preemption and recomputation (and the same for seeded sampling)."""
    prompts = prompts_of_lengths([5, 14, 23, 9, 30, 18, 11, 26], seed=7)
    kw = dict(method=method, k=3, M=64, max_num_seqs=6, max_batched=64,
              speculative={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    roomy_cfg, roomy_plan = make_config(models["target"], models["draft"], **kw)
    tight_cfg, tight_plan = make_config(models["target"], models["draft"], cache={"block_size": 4, "num_blocks": 24}, **kw)
    for params in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}):
        roomy = run_engine(make_engine(roomy_cfg, roomy_plan), prompts, max_tokens=30, **dict(params))
        tight_engine = make_engine(tight_cfg, tight_plan)
        tight = run_engine(tight_engine, prompts, max_tokens=30, **dict(params))
        assert tight_engine.counters.preemptions > 0
        assert tight_engine.pool.num_free == 24                  # every block came back
        for i in range(len(prompts)):
            assert tight[i].generated == roomy[i].generated, (params, i)
            assert tight[i].finish_reason == roomy[i].finish_reason


def test_num_blocks_below_one_sequence_is_refused(models):
    from specdp_cli.config import validate
    from specdp_cli.preflight import run_preflight
    cfg = validate({"model": str(models["target"]), "max_model_len": 64, "device": "cpu", "dtype": "float32",
                    "speculative": {"method": "none"}, "cache": {"num_blocks": 3}})
    report = run_preflight(cfg)
    assert not report.ok and any("not even one sequence" in e for e in report.errors)


@pytest.fixture(scope="module")
def runner(models):
    model = load_model(str(models["target"]), torch.float32, torch.device("cpu"), 128)
    allocate_kv(model, 40, 4)
    bt = torch.zeros((8, 32), dtype=torch.int32)
    return ModelRunner(model, torch.device("cpu"), bt, 4, 8, [3, 8], window=3)


def _hf_logits(models, tokens):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(models["target"]), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _forward(runner, R, T, rows):
    """rows: (blocks, start, tokens, n_real, out_start); rows past them are padding."""
    bt = runner.block_table
    bt.zero_()
    ids = torch.zeros((R, T), dtype=torch.long)
    start, n_real, out = (torch.zeros(R, dtype=torch.long) for _ in range(3))
    for i, (blocks, s, toks, n, o) in enumerate(rows):
        bt[i, :len(blocks)] = torch.tensor(blocks)
        ids[i, :len(toks)] = torch.tensor(toks)
        start[i], n_real[i], out[i] = s, n, o
    runner.set_rows(R, ids, start, n_real, out)
    return runner.forward(R, T).clone()


def test_attention_over_block_tables_padded_and_unpadded(models, runner):
    """Two sequences in scattered blocks, prefilled by one forward (a prompt cut into rows of the
    same sequence), then verified by forwards of 2 rows and of 4 rows (2 padding) and by a wider
    forward: the same logits, equal to transformers' forward over each whole sequence."""
    a, b = prompts_of_lengths([13, 6], seed=9)
    blocks = {"a": [9, 3, 17, 5, 11], "b": [22, 2, 30]}          # out of order, interleaved
    nxt_a, nxt_b = [41, 42, 43], [51, 52, 53]
    _forward(runner, 3, 8, [(blocks["a"], 0, a[:8], 8, 7), (blocks["a"], 8, a[8:], 5, 4), (blocks["b"], 0, b, 6, 5)])
    ref_a = _hf_logits(models, a + nxt_a)[len(a):]
    ref_b = _hf_logits(models, b + nxt_b[:2])[len(b):]
    rows = [(blocks["a"], len(a), nxt_a, 3, 0), (blocks["b"], len(b), nxt_b, 2, 0)]   # row b: its third token is padding
    two, four, wide = _forward(runner, 2, 3, rows), _forward(runner, 4, 3, rows), _forward(runner, 2, 8, rows)
    torch.testing.assert_close(four[:2], two, rtol=0, atol=1e-5)
    torch.testing.assert_close(wide, two, rtol=0, atol=1e-5)
    torch.testing.assert_close(two[0], ref_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(two[1, :2], ref_b, rtol=1e-4, atol=1e-4)


def test_preflight_and_engine_count_kv_bytes_alike(models):
    """One memory model: the KV bytes per token preflight reports from config.json are what the engine's
    pool is sized with once the model is loaded."""
    from specdp_cli.modeldir import ModelDir
    from specdp_cli.runtime.kv_cache import kv_bytes_per_token

    for role in ("target", "draft"):
        md = ModelDir.open(str(models[role]), role)
        model = load_model(str(models[role]), torch.float32, torch.device("cpu"), 64)
        assert md.kv_shapes() == model.kv_shapes()
        assert md.kv_bytes_per_token("float32") == kv_bytes_per_token(model) > 0


def test_staged_block_table_follows_a_sequences_blocks():
    """A step stages each row's block table from an int32 copy of its sequence's blocks, made again only when the
    blocks change: grown in place, or replaced (a preempted sequence's new blocks, as many as before)."""
    from specdp_cli.runtime.scheduler import Sequence
    from specdp_cli.runtime.step_inputs import RowSpec, StepInputs

    si = StepInputs(4, 4, 6, torch.device("cpu"))
    seq = Sequence(Request("r", [1, 2, 3], SamplingParams(max_tokens=8)), 64)

    def staged():
        si.stage([RowSpec(seq, 0, [1], 1)], 2)
        return si.block_table[0].tolist()

    seq.blocks = [4, 2]
    assert staged() == [4, 2, 0, 0, 0, 0]
    seq.blocks += [7]
    assert staged() == [4, 2, 7, 0, 0, 0]
    seq.blocks = []
    seq.blocks = [5, 1, 3]
    assert staged() == [5, 1, 3, 0, 0, 0]
