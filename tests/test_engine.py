"""The engine on one rank: greedy speculative output equals transformers' greedy output token for
token (float32), for every drafter, two model families, chunked prefill, sequences that reach M
and a drafter whose limit D is below M."""
import pytest

import engine_util

from engine_util import hf_reference, make_config, make_engine, prompts_of_lengths, run_engine
from helpers import make_model_dir

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]   # M = 64: the longest prompts reach M within a few tokens


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("qwen")
    return {"target": make_model_dir(root / "target", models["tokenizer"], family="qwen2", seed=5),
            "draft": make_model_dir(root / "draft", models["tokenizer"], family="qwen2", layers=1, seed=6)}


def check_against_reference(target, done, prompts, max_tokens, M):
    """As engine_util's, and a sequence reaching M finished for its length."""
    engine_util.check_against_reference(target, done, prompts, max_tokens, M)
    for i, p in enumerate(prompts):
        if len(p) + len(done[i].generated) == M:
            assert done[i].finish_reason == "length"


@pytest.mark.parametrize("method", ["draft_model", "ngram", "none"])
def test_greedy_equals_reference_llama(models, method):
    M = 64
    cfg, plan = make_config(models["target"], models["draft"], method=method, k=3, M=M, max_num_seqs=4,
                            max_batched=24, speculative={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(models["target"], done, prompts, 30, M)
    if method != "none":
        assert engine.counters.spec.num_drafts > 0
    # max_num_batched_tokens 24 < longest prompts: those were prefilled in chunks
    assert max(LENGTHS) > 24


def test_greedy_equals_reference_with_drafter_limit_below_M(models):
    M, D, k = 64, 40, 3
    cfg, plan = make_config(models["target"], models["draft"], k=k, M=M, D=D, max_num_seqs=3, max_batched=64)
    assert plan.drafter_max_model_len == D and plan.no_draft_window == [D - k + 1, M - 1]
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths([5, 20, 30, 36, 37, 45, 60, 12], seed=1)
    done = run_engine(engine, prompts, max_tokens=40)
    check_against_reference(models["target"], done, prompts, 40, M)
    # sequences crossing into the window went on without drafts
    assert engine.counters.spec.num_drafts > 0


def test_greedy_equals_reference_qwen2(qwen):
    M = 64
    for method in ("draft_model", "ngram"):
        cfg, plan = make_config(qwen["target"], qwen["draft"], method=method, k=4, M=M, max_num_seqs=5)
        done = run_engine(make_engine(cfg, plan), prompts_of_lengths(LENGTHS, seed=2), max_tokens=25)
        check_against_reference(qwen["target"], done, prompts_of_lengths(LENGTHS, seed=2), 25, M)


def test_copy_of_target_accepts_everything(models, tmp_path):
    copy = make_model_dir(tmp_path / "copy", models["tokenizer"], copy_of=models["target"])
    cfg, plan = make_config(models["target"], copy, k=4, M=64, max_num_seqs=4)
    engine = make_engine(cfg, plan)
    run_engine(engine, prompts_of_lengths([4, 8, 12, 16, 20, 24, 28, 30], seed=3), max_tokens=20)
    s = engine.counters.spec
    assert s.num_draft_tokens > 0
    assert s.num_accepted_tokens == s.num_draft_tokens        # acceptance rate exactly 1.0


def test_eos_stops_and_is_excluded(models, tmp_path):
    """Make the target's most frequent output token its eos: sequences stop early, without it."""
    import shutil

    from helpers import set_eos
    prompts = prompts_of_lengths([6, 11, 19, 23], seed=4)
    outs = [hf_reference(models["target"], p, 20, eos=None) for p in prompts]
    counts = {}
    for o in outs:
        for t in o[2:]:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    tdir = shutil.copytree(models["target"], tmp_path / "t")
    set_eos(tdir, eos)
    cfg, plan = make_config(tdir, models["draft"], k=3, M=64)
    done = run_engine(make_engine(cfg, plan), prompts, max_tokens=20)
    stopped = 0
    for i, p in enumerate(prompts):
        ref = hf_reference(tdir, p, 20, eos=eos)
        assert done[i].generated == ref
        assert eos not in done[i].generated
        if done[i].finish_reason == "stop":
            stopped += 1
    assert stopped >= 1


def test_seeded_sampling_is_reproducible(models):
    cfg, plan = make_config(models["target"], models["draft"], k=3, M=64, max_num_seqs=4)
    prompts = prompts_of_lengths([5, 10, 15, 20, 25], seed=5)
    params = dict(temperature=0.9, top_p=0.95, top_k=50)
    a = run_engine(make_engine(cfg, plan), prompts, max_tokens=20, seed=7, **params)
    b = run_engine(make_engine(cfg, plan), prompts, max_tokens=20, seed=7, **params)
    assert [a[i].generated for i in a] == [b[i].generated for i in a]
    # the draws belong to the request, not the batch: served one at a time, the same tokens
    cfg1, plan1 = make_config(models["target"], models["draft"], k=3, M=64, max_num_seqs=1)
    c = run_engine(make_engine(cfg1, plan1), prompts, max_tokens=20, seed=7, **params)
    assert [a[i].generated for i in a] == [c[i].generated for i in a]
    d = run_engine(make_engine(cfg, plan), prompts, max_tokens=20, seed=8, **params)
    assert [a[i].generated for i in a] != [d[i].generated for i in a]
