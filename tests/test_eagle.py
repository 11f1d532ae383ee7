"""method: eagle (EAGLE-1 heads): the head computes what the published head computes, greedy float32
output equals target-only output token for token (prompts crossing D and M), a head that predicts
the target exactly has every draft accepted, seeded sampling does not depend on the batch, dp 2 in
lockstep equals dp 1, a dummy step that skips forwards is caught, and preflight reads the layout."""
import json

import pytest
import torch

from dp_util import HARD_TIMEOUT_S, dp_config, generate_args, lockstep_run_equals_dp1, selected, text_rows, write_jsonl
from engine_util import (check_against_reference, make_config, make_engine, prompts_of_lengths, run_engine,
                         single_row_runner)
from helpers import bigram_target, make_eagle_head

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]      # M = 64: the longest prompts reach M within a few tokens


@pytest.fixture(scope="module")
def eagle(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("eagle")
    bigram = bigram_target(root / "bigram", models["tokenizer"])
    return {"head": make_eagle_head(root / "head", models["target"]),
            "bigram": bigram, "perfect": make_eagle_head(root / "perfect", bigram, perfect=True)}


def test_head_forward_equals_the_published_head(models, eagle):
    """specdp's head over paged KV = fc + a Llama decoder layer without its input norm (RoPE at the
    feature's position), as EAGLE-1 trains it."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from specdp_cli.runtime.models.eagle import load_eagle_head
    from specdp_cli.runtime.models.loader import load_model

    cpu, N, bs = torch.device("cpu"), 21, 4
    target = load_model(str(models["target"]), torch.float32, cpu, 64)
    head = load_eagle_head(str(eagle["head"]), target, torch.float32, cpu, 64)
    runner = single_row_runner(head, N, bs)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, head.vocab_size, (N,), generator=g)
    feats = torch.randn(N, head.embed.shape[1], generator=g)
    head.feats = feats
    runner.set_rows(1, ids.view(1, N), torch.zeros(1, dtype=torch.long), torch.full((1,), N), torch.zeros(1, dtype=torch.long))
    ours = runner.forward(1, N, graphs=False)
    ours_hidden = runner.hidden[:N]

    w = {k: v.float() for k, v in load_file(str(eagle["head"] / "model.safetensors")).items()}
    cfg = LlamaConfig(**{k: v for k, v in json.loads((eagle["head"] / "config.json").read_text()).items()
                         if k not in ("architectures", "model_type")})
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}, strict=False)
    x = torch.nn.functional.linear(torch.cat([torch.nn.functional.embedding(ids, target.embed), feats], -1),
                                   w["fc.weight"], w["fc.bias"])[None]
    pos = torch.arange(N)[None]
    mask = torch.full((N, N), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos))
    ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
    torch.testing.assert_close(ours_hidden, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours[0], torch.nn.functional.linear(ref, target.lm_head), rtol=1e-4, atol=1e-4)


def test_greedy_equals_target_only(models, eagle):
    M = 64
    cfg, plan = make_config(models["target"], eagle["head"], method="eagle", k=3, M=M, max_num_seqs=4, max_batched=24)
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(models["target"], done, prompts, 30, M)
    assert engine.counters.spec.num_drafts > 0
    assert max(LENGTHS) > 24                   # the longest prompts were prefilled in chunks


def test_greedy_with_head_limit_below_M(models, eagle):
    M, D, k = 64, 40, 3
    cfg, plan = make_config(models["target"], eagle["head"], method="eagle", k=k, M=M, D=D, max_num_seqs=3)
    assert plan.drafter_max_model_len == D and plan.no_draft_window == [D - k + 1, M - 1]
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths([5, 20, 30, 36, 37, 45, 60, 12], seed=1)
    done = run_engine(engine, prompts, max_tokens=40)
    check_against_reference(models["target"], done, prompts, 40, M)


def test_a_head_that_predicts_the_target_has_every_draft_accepted(models, eagle):
    M = 64
    cfg, plan = make_config(eagle["bigram"], eagle["perfect"], method="eagle", k=3, M=M, max_num_seqs=4, max_batched=24)
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=3)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(eagle["bigram"], done, prompts, 30, M)
    s = engine.counters.spec
    assert s.num_draft_tokens > 50 and s.num_accepted_tokens == s.num_draft_tokens


def test_seeded_sampling_does_not_depend_on_the_batch(models, eagle):
    prompts = prompts_of_lengths([5, 10, 15, 20, 25], seed=5)
    params = dict(temperature=0.9, top_p=0.95, top_k=50)
    cfg, plan = make_config(eagle["bigram"], eagle["perfect"], method="eagle", k=3, M=64, max_num_seqs=4)
    a = run_engine(make_engine(cfg, plan), prompts, max_tokens=20, seed=7, **params)
    cfg1, plan1 = make_config(eagle["bigram"], eagle["perfect"], method="eagle", k=3, M=64, max_num_seqs=1)
    b = run_engine(make_engine(cfg1, plan1), prompts, max_tokens=20, seed=7, **params)
    assert [a[i].generated for i in a] == [b[i].generated for i in a]
    c = run_engine(make_engine(cfg, plan), prompts, max_tokens=20, seed=8, **params)
    assert [a[i].generated for i in a] != [c[i].generated for i in a]


@pytest.fixture(scope="module", autouse=True)
def eagle_jobs(request, tmp_path_factory, models, eagle, launches) -> dict:
    """The lockstep test's two commands (the job in lockstep; the same inputs with rank 0 running one drafter
    forward over its padding batch) and the server test's server, started when this module starts, while the
    in-process tests run."""
    jobs = {}
    if selected(request, "test_server_in_lockstep_equals_generate"):
        from test_serve import free_port, server_config, start_server_ahead

        tmp, port = tmp_path_factory.mktemp("eagle_serve"), free_port()
        cfg = server_config(tmp, models, port, speculative={"method": "eagle", "model": str(eagle["head"])})
        start_server_ahead(request, launches, "server", cfg, port)
        jobs["server"] = (tmp, (cfg, port, lambda: launches.result("server")))
    if not selected(request, "test_lockstep_dp2_equals_dp1_and_a_short_dummy_step_is_caught"):
        return jobs
    tmp = tmp_path_factory.mktemp("eagle_job")
    rows = text_rows(models["tokenizer"], [30, 4, 7, 10, 13], [30, 2, 9, 16, 5], seed=22)
    inp = write_jsonl(tmp / "in.jsonl", rows)
    cfg = dp_config(tmp, models["target"], eagle["head"], dp=2, dp_sync="always", method="eagle", k=3,
                    M=64, D=40, check=True)
    launches.start("lockstep", *generate_args(tmp, inp, cfg))
    fault = dp_config(tmp, models["target"], eagle["head"], dp=2, dp_sync="always", method="eagle", k=3,
                      M=64, name="fault.yaml", timeout_s=60)
    launches.start("fault", "generate", fault, "--input", inp, "--output", tmp / "f.jsonl",
                   env={"SPECDP_FAULT": "single-dummy-forward:0"}, exclusive=True)   # rank 0 idles at the end
    return {**jobs, "tmp": tmp, "inp": inp, "cfg": cfg}


@pytest.mark.timeout(HARD_TIMEOUT_S * 2)
def test_lockstep_dp2_equals_dp1_and_a_short_dummy_step_is_caught(eagle_jobs, launches):
    ranks = lockstep_run_equals_dp1(eagle_jobs["tmp"], eagle_jobs["inp"], eagle_jobs["cfg"],
                                    launched=lambda: launches.result("lockstep"))
    assert len({x["steps"] for x in ranks}) == 1 and any(x["padding_steps"] > 0 for x in ranks)

    r, secs = launches.result("fault")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "out of step" in r.stderr and "rank 0 at step" in r.stderr and "drafter forward" in r.stderr, r.stderr
    assert secs < 60


def test_preflight_reads_the_head(tmp_path, models, eagle):
    from safetensors.torch import save_file

    from specdp_cli.config import validate
    from specdp_cli.preflight import run_preflight

    def report(head):
        return run_preflight(validate({"model": str(models["target"]), "max_model_len": 64, "device": "cpu",
                                       "speculative": {"method": "eagle", "model": str(head)}}))

    ok = report(eagle["head"])
    assert ok.ok, ok.errors
    files = next(c for c in ok.checks if c.name == "files").detail
    assert "EAGLE-1 layout, bfloat16 tensors" in files            # the tensors' dtype, not config.json's
    assert ok.plan.policy == "skip" and ok.plan.drafter_max_model_len == 64

    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    (eagle3 / "config.json").write_text((eagle["head"] / "config.json").read_text())
    save_file({"midlayer.self_attn.q_proj.weight": torch.zeros(4, 4), "d2t": torch.zeros(4, dtype=torch.long)},
              str(eagle3 / "model.safetensors"))
    assert any("EAGLE-3 (midlayer.*, d2t) layout: use speculative.method: eagle3" in e for e in report(eagle3).errors)
    assert any("not an EAGLE head" in e for e in report(models["draft"]).errors)

    wrong = make_eagle_head(tmp_path / "wrong", models["draft"])          # trained for a 32-wide model
    assert any("hidden_size 32 but the target's is 64" in e for e in report(wrong).errors)

    lockstep = run_preflight(validate({"model": str(models["target"]), "max_model_len": 64, "device": "cpu",
                                       "speculative": {"method": "eagle", "model": str(eagle["head"])},
                                       "parallel": {"data_parallel_size": 2, "dp_sync": "always"}}))
    assert lockstep.plan.policy == "dummy"


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_preemption_keeps_outputs(tmp_path, models, eagle, method):
    """Sequences needing more KV blocks than there are finish through preemption with a roomy run's
    tokens (the head's cache is recomputed with the target's; proposals made before are dropped)."""
    from helpers import make_eagle3_head

    head = eagle["head"] if method == "eagle" else make_eagle3_head(tmp_path / "e3", models["target"], draft_vocab=96)
    prompts = prompts_of_lengths([5, 14, 23, 9, 30, 18, 11, 26], seed=7)
    kw = dict(method=method, k=3, M=64, max_num_seqs=6, max_batched=64)
    roomy = run_engine(make_engine(*make_config(models["target"], head, **kw)), prompts, max_tokens=30)
    tight_engine = make_engine(*make_config(models["target"], head, cache={"block_size": 4, "num_blocks": 28}, **kw))
    tight = run_engine(tight_engine, prompts, max_tokens=30)
    assert tight_engine.counters.preemptions > 0 and tight_engine.pool.num_free == 28
    assert [tight[i].generated for i in range(8)] == [roomy[i].generated for i in range(8)]


@pytest.mark.timeout(HARD_TIMEOUT_S * 2)
def test_server_in_lockstep_equals_generate(models, eagle_jobs):
    from test_serve import serving

    tmp, ahead = eagle_jobs["server"]
    with serving(tmp, models, ahead) as (complete, expected, server):
        assert complete() == expected
        assert server.metric("specdp:spec_decode_num_drafts") > 0


def interpreted_head_checks() -> None:
    """The first head forward's inputs in one kernel (`triton_kernels.head_inputs`, CUDA) against the torch
    expressions the CPU runs, under Triton's interpreter (test_kernels_interpreted.py runs it): decode rows, prompt
    rows with a known next token and one whose next token is drawn (-2), padding rows (zeros); strided columns; and
    the step between draft forwards (`triton_kernels.next_draft`); an MTP layer's input norms (`embed_norm_pair`)."""
    from specdp_cli.runtime import triton_kernels as tk
    from specdp_cli.runtime.drafters.eagle import head_inputs
    g = torch.Generator().manual_seed(0)
    R, T, W = 6, 5, 4
    staged = torch.randint(0, 9, (R, 7), generator=g)
    ids = torch.randint(0, 50, (R, T + 2), generator=g)[:, :T]             # strided rows, as the target's buffer
    start, n_real, nxt = staged[:, 1], staged[:, 3], staged[:, 5]
    n_real.copy_(torch.tensor([2, 4, 5, 3, 0, 1]))
    nxt.copy_(torch.tensor([-1, -1, 17, -2, 0, -1]))
    tokens, n_out = torch.randint(0, 50, (R, W), generator=g), torch.tensor([1, 3, 1, 1, 1, 4])
    want = head_inputs(ids, tokens, n_out, start, n_real, nxt)
    got = [torch.zeros(R * T, dtype=torch.long)] + [torch.zeros(R, dtype=torch.long) for _ in range(5)]
    tk.head_inputs(ids, tokens, n_out, start, n_real, nxt, *got)
    assert torch.equal(got[0].view(R, T), want[0]) and torch.equal(got[1], start) and torch.equal(got[2], n_real)
    for a, b in zip(got[3:], want[1:]):
        assert torch.equal(a, b), (a, b)
    d, drafts = torch.tensor([5, 6, 7]), torch.zeros(3, 4, dtype=torch.long)
    start, ids, hidden = torch.tensor([10, 20, 30, 40]), torch.zeros(8, dtype=torch.long), torch.randn(5, 1100, generator=g)
    feats = torch.zeros(5, 1100)
    tk.next_draft(d, drafts, 2, start, ids, feats, hidden, 3)
    assert drafts[:, 2].tolist() == [5, 6, 7] and not drafts[:, [0, 1, 3]].any() and ids[:4].tolist() == [5, 6, 7, 0]
    assert start.tolist() == [11, 21, 31, 40] and torch.equal(feats[:3], hidden[:3]) and not feats[3:].any()
    # an MTP layer's input: [enorm(embedding) | hnorm(feature)] in one kernel, as the two norm kernels compute it
    embed, feats = torch.randn(40, 96, generator=g), torch.randn(5, 96, generator=g)
    ew, fw, tok = torch.randn(96, generator=g), torch.randn(96, generator=g), torch.tensor([3, 39, 0, 3, 17])
    got = tk.embed_norm_pair(tok, embed, ew, feats, fw, 1e-6)
    assert torch.equal(got, torch.cat([tk.rms_norm(embed[tok], ew, 1e-6), tk.rms_norm(feats, fw, 1e-6)], -1))
    print("interpreted head inputs: ok")

