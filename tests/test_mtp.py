"""method: mtp (DeepSeek-V3's multi-token-prediction layer, read from the target's own checkpoint): one draft
step computes what the layer computes with transformers' decoder layer, greedy float32 output equals
target-only output, an MTP layer that predicts the target has every draft accepted, expert parallelism over
2 and 3 ranks equals one rank (the MTP layer's experts split too), a dummy step that skips or shortens the
drafter's forwards is caught — and without that guard the same fault cannot finish — and preflight's verdicts."""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from dp_util import (HARD_TIMEOUT_S, dp_config, generate_args, lockstep_run_equals_dp1, read_out, selected, text_rows,
                     write_jsonl)
from engine_util import (check_against_reference, eos_variant, hf_reference, make_config, make_engine,
                         prompts_of_lengths, run_engine, single_row_runner)
from helpers import make_deepseek_dir, write_config

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]      # M = 64: the longest prompts reach M within a few tokens
MTP = "model.layers.3."                             # the tiny DeepSeek-V3 targets have 3 decoder layers


@pytest.fixture(scope="module")
def mtp(tmp_path_factory, models):
    """lora / plain: random targets with a random MTP layer (q LoRA and interleaved rotary pairs, or neither);
    bigram: a target whose next token depends on the current one, with an MTP layer that predicts it;
    no_mtp: a DeepSeek-V3 checkpoint without the MTP layer's tensors (config.json still counts one)."""
    root = tmp_path_factory.mktemp("mtp")
    tok = models["tokenizer"]
    return {"lora": make_deepseek_dir(root / "lora", tok, seed=3),
            "plain": make_deepseek_dir(root / "plain", tok, q_lora_rank=None, rope_interleave=False, seed=4),
            "bigram": make_deepseek_dir(root / "bigram", tok, seed=5, bigram=True),
            "no_mtp": make_deepseek_dir(root / "no_mtp", tok, seed=6, mtp_layer=False)}


def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_a_draft_step_is_the_mtp_layer(mtp):
    """specdp's MTP step over paged KV = shared_head(decoder layer(eh_proj(cat(enorm(embedding), hnorm(feature)))))
    with transformers' DeepSeek-V3 decoder layer (latent attention, MoE with a shared expert) as layer 3."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from specdp_cli.runtime.models.loader import load_head
    from specdp_cli.runtime.models.loader import load_model

    torch.set_num_threads(1)
    cpu, N, bs = torch.device("cpu"), 21, 4
    target = load_model(str(mtp["lora"]), torch.float32, cpu, 64)
    head = load_head("mtp", str(mtp["lora"]), target, torch.float32, cpu, 64)
    assert head.layers[0].moe is not None and head.layers[0].mla is not None
    runner = single_row_runner(head, N, bs)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, head.vocab_size, (N,), generator=g)
    feats = torch.randn(N, 64, generator=g)
    head.feats = feats.clone()
    runner.set_rows(1, ids.view(1, N), torch.zeros(1, dtype=torch.long), torch.full((1,), N),
                    torch.zeros(1, dtype=torch.long))
    ours = runner.forward(1, N, graphs=False)[0]
    ours_hidden = runner.hidden[:N]

    # transformers loads the MTP layer's decoder layer as a fourth layer when told there are four
    ref_model = AutoModelForCausalLM.from_pretrained(str(mtp["lora"]), dtype=torch.float32, num_hidden_layers=4).eval()
    w = load_file(str(next(mtp["lora"].glob("*.safetensors"))))
    x = F.linear(torch.cat([rms(F.embedding(ids, w["model.embed_tokens.weight"]), w[MTP + "enorm.weight"]),
                            rms(feats, w[MTP + "hnorm.weight"])], -1), w[MTP + "eh_proj.weight"])[None]
    pos = torch.arange(N)[None]
    mask = torch.full((N, N), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = ref_model.model.layers[3](x, attention_mask=mask, position_ids=pos,
                                        position_embeddings=ref_model.model.rotary_emb(x, pos))[0]
    torch.testing.assert_close(ours_hidden, ref, rtol=1e-4, atol=1e-5)
    logits = F.linear(rms(ref, w[MTP + "shared_head.norm.weight"]), w[MTP + "shared_head.head.weight"])
    torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-4)


def test_own_embedding_and_missing_head(tmp_path, mtp):
    """An MTP layer with embed_tokens of its own uses it; one without shared_head.head uses the target's LM head."""
    from safetensors.torch import load_file, save_file

    from specdp_cli.runtime.models.loader import load_head
    from specdp_cli.runtime.models.loader import load_model

    d = shutil.copytree(mtp["lora"], tmp_path / "t")
    f = next(d.glob("*.safetensors"))
    w = load_file(str(f))
    w[MTP + "embed_tokens.weight"] = torch.randn_like(w["model.embed_tokens.weight"])
    del w[MTP + "shared_head.head.weight"]
    save_file(w, str(f), metadata={"format": "pt"})
    target = load_model(str(d), torch.float32, torch.device("cpu"), 64)
    head = load_head("mtp", str(d), target, torch.float32, torch.device("cpu"), 64)
    assert torch.equal(head.embed, w[MTP + "embed_tokens.weight"]) and head.lm_head is target.lm_head


def test_under_expert_parallelism_the_mtp_layer_holds_this_ranks_experts(mtp):
    from specdp_cli.runtime.models.loader import load_head
    from specdp_cli.runtime.models.loader import load_model

    for rank, want in ((0, range(2)), (1, range(2, 3)), (2, range(3, 4))):
        ep = SimpleNamespace(world=3, rank=rank)
        target = load_model(str(mtp["lora"]), torch.float32, torch.device("cpu"), 64, ep=ep)
        moe = load_head("mtp", str(mtp["lora"]), target, torch.float32, torch.device("cpu"), 64, ep=ep).layers[0].moe
        assert moe.experts == want and moe.gate_up.shape[0] == len(want) and moe.ep is ep
        assert moe.route.router.shape == (4, 64) and moe.shared_gate_up is not None


@pytest.mark.parametrize("variant,D", [("lora", None), ("plain", 40)])
def test_greedy_equals_target_only(models, mtp, variant, D):
    M = 64
    cfg, plan = make_config(mtp[variant], method="mtp", k=3, M=M, D=D, max_num_seqs=4, max_batched=24)
    assert plan.drafter_max_model_len == (D or M)
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=6)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(mtp[variant], done, prompts, 30, M, variant)
    assert engine.counters.spec.num_drafts > 0


def test_an_mtp_layer_that_predicts_the_target_has_every_draft_accepted(mtp):
    """Step 1 takes the token after each verified position, steps 2..k their own drafts: with a layer
    that passes the token's embedding through to the target's own norm and LM head, every draft is right."""
    M = 64
    cfg, plan = make_config(mtp["bigram"], method="mtp", k=3, M=M, max_num_seqs=4, max_batched=24)
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=3)
    done = run_engine(engine, prompts, max_tokens=30)
    for i, p in enumerate(prompts):
        assert done[i].generated == hf_reference(mtp["bigram"], p, min(30, M - len(p)))
    s = engine.counters.spec
    assert s.num_draft_tokens > 50 and s.num_accepted_tokens == s.num_draft_tokens


@pytest.fixture(scope="module")
def eos_target(tmp_path_factory, mtp):
    """The lora target with a token it often emits made eos, so some sequences stop early."""
    prompts = prompts_of_lengths([30] + SHORT, seed=22)        # ep_inputs' prompts
    return eos_variant(mtp["lora"], prompts, tmp_path_factory.mktemp("mtp_eos") / "target")


SHORT = [4, 7, 10, 13]        # prompts that never reach the no-draft window


def ep_inputs(tmp_path, tokenizer, n_short: int):
    """One long request crossing the no-draft window [38, 63] (the longest: rank 0 gets it), and short ones."""
    rows = text_rows(tokenizer, [30] + SHORT[:n_short], [30, 9, 16, 5, 12][:1 + n_short], seed=22)
    return write_jsonl(tmp_path / "in.jsonl", rows)


def ep_config(tmp_path, target, dp, **kw):
    return dp_config(tmp_path, target, None, dp=dp, dp_sync="auto", method="mtp", k=3, M=64, D=40,
                     parallel={"enable_expert_parallel": True}, **kw)


def fault_inputs(tmp_path, models):
    """A long and a short request over 2 expert-parallel ranks: rank 1 idles once its request ends."""
    return write_jsonl(tmp_path / "in.jsonl", text_rows(models["tokenizer"], [12, 3], [30, 2], seed=23))


@pytest.fixture(scope="module", autouse=True)
def mtp_jobs(request, tmp_path_factory, models, mtp, launches) -> dict:
    """Every selected test's command, started when this module starts (two at a time while the in-process tests
    above run): {key: (run directory, input, config, dp 1 reference config)}."""
    jobs = {}

    def fault_job(fault, timeout_s, exclusive):
        tmp = tmp_path_factory.mktemp("mtp_fault")
        inp, cfg = fault_inputs(tmp, models), ep_config(tmp, mtp["lora"], 2, timeout_s=timeout_s, name="fault.yaml")
        jobs[fault] = (tmp, inp, cfg, None)
        launches.start(fault, "generate", cfg, "--input", inp, "--output", tmp / "out.jsonl",
                       env={"SPECDP_FAULT": fault}, exclusive=exclusive)

    # first: without the guard the job spends most of its run idle, waiting out its 8 s collective timeout while the
    # launch beside it has the CPU
    for p in selected(request, "test_without_the_guard_the_fault_cannot_finish"):
        fault_job(p["fault"] + ",no-guard", 8, False)
    for p in selected(request, "test_expert_parallel_equals_dp1"):
        dp, n_short = p["dp"], p["n_short"]
        tmp, target = tmp_path_factory.mktemp("mtp_job"), request.getfixturevalue("eos_target")
        inp = ep_inputs(tmp, models["tokenizer"], n_short)
        ref = dp_config(tmp, target, None, dp=1, method="mtp", k=3, M=64, D=40, name="ref.yaml")
        cfg = ep_config(tmp, target, dp, check=True)
        jobs[("ep", dp)] = (tmp, inp, cfg, ref)
        launches.start(("ep", dp), *generate_args(tmp, inp, cfg))
    for p in selected(request, "test_a_short_dummy_step_is_caught"):
        fault_job(p["fault"], 60, True)              # exclusive: the test bounds the command's wall time
    return jobs


@pytest.mark.timeout(HARD_TIMEOUT_S * 2)
@pytest.mark.parametrize("dp,n_short", [(2, 4), (3, 1)])
def test_expert_parallel_equals_dp1(mtp_jobs, launches, dp, n_short):
    """The target's and the MTP layer's experts split over the ranks (3 ranks: 2 + 1 + 1): the tokens of one
    rank holding every expert, with the long request in the no-draft window on one rank only, early stops,
    and (dp 3, two requests) a rank that holds none and runs every forward over padding."""
    tmp_path, inp, cfg, ref = mtp_jobs[("ep", dp)]
    ranks = lockstep_run_equals_dp1(tmp_path, inp, cfg, ref, launched=lambda: launches.result(("ep", dp)))
    want = read_out(tmp_path / "ref.jsonl")
    long = want[json.dumps("r0")]
    assert long["prompt_tokens"] + long["completion_tokens"] > 40 - 3, "the long request never reached the window"
    if n_short > 1:
        assert any(r["finish_reason"] == "stop" for r in want.values()), "no early stop in the reference"
    assert len(ranks) == dp and len({x["steps"] for x in ranks}) == 1
    assert any(x["padding_steps"] > 0 for x in ranks) and all(x["skipped_drafter_steps"] == 0 for x in ranks)
    if dp == 3:
        assert min(x["requests"] for x in ranks) == 0


@pytest.mark.timeout(HARD_TIMEOUT_S * 2)
@pytest.mark.parametrize("fault", ["skip-drafter:1", "single-dummy-forward:1"])
def test_a_short_dummy_step_is_caught(launches, fault):
    r, secs = launches.result(fault)
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr
    assert "out of step" in err and "rank 0 at step" in err and "rank 1 at step" in err, err
    assert "3 drafter forwards planned" in err and ("0 drafter forwards planned" if fault.startswith("skip")
                                                    else "1 drafter forward planned") in err, err
    assert secs < 60, secs                     # caught at the step sync, not by the collective timeout


@pytest.mark.timeout(HARD_TIMEOUT_S * 2)
@pytest.mark.parametrize("fault", ["single-dummy-forward:1"])      # (skip-drafter: the same collectives, one fewer)
def test_without_the_guard_the_fault_cannot_finish(mtp_jobs, launches, fault):
    """The MTP layer's forwards are real collectives: with the step sync's comparison switched off (test-only
    `no-guard`), rank 1 runs fewer of them — its first, which learns the verified positions, runs every step;
    the fault cuts the rest — while rank 0 waits in its second forward's MoE all-gather, and the job dies of
    the collective timeout (or the backend's error once rank 1 is gone) instead of producing output. Which rank
    gives up first is a race: rank 0 in its all-gather, or rank 1 waiting for rank 0's next step sync; either way
    the report says rank 0 was in its second drafter forward."""
    r, _ = launches.result(fault + ",no-guard")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "out of step" not in r.stderr, r.stderr
    assert "rank 0 stopped:" in r.stderr or "rank 1 stopped:" in r.stderr, r.stderr
    assert "drafter forward 2/3" in r.stderr, r.stderr
    assert not (mtp_jobs[fault + ",no-guard"][0] / "out.jsonl").exists()


# -- validate config ------------------------------------------------------------------------------

def validate(tmp_path, target, json_out=True, **extra):
    from specdp_cli.cli import app

    data = {"model": str(target), "max_model_len": 64, "device": "cpu",
            "speculative": {"method": "mtp", "num_speculative_tokens": 3},
            "parallel": {"data_parallel_size": 2, "enable_expert_parallel": True}}
    for key, v in extra.items():
        data[key] = {**data.get(key, {}), **v}
    res = CliRunner().invoke(app, ["validate", "config", str(write_config(tmp_path / "c.yaml", data))]
                             + (["--json"] if json_out else []))
    return res.exit_code, json.loads(res.stdout) if json_out else res.stdout


def test_validate_config_json(tmp_path, models, mtp):
    code, out = validate(tmp_path, mtp["lora"])
    assert code == 0 and out["ok"], out["errors"]
    assert out["policy"] == "dummy" and out["dp_sync"] == "always" and out["drafter_max_model_len"] == 64
    assert out["no_draft_window"] == [62, 63] and out["warnings"] == []
    rows = {c["name"]: c["detail"] for c in out["checks"]}
    assert "MTP layer model.layers.3.* in the target's checkpoint (the target's embedding, its shared_head.head)" \
        in rows["files"]
    # 4 layers (3 + the MTP layer) x 4 heads x (key 24 + value 16) x 4 bytes = 2.5 KiB
    assert "with the MTP layer per rank (experts split)" in rows["memory"]
    assert "2.5 KiB per token with the MTP layer" in rows["memory"]
    assert "runs the drafter's 3 forwards over a padding batch" in rows["policy"]

    code, out = validate(tmp_path, mtp["lora"], speculative={"model": str(models["draft"])})
    assert code == 0 and out["warnings"] == [
        "files: speculative.model is set but method is mtp: it is not used (the drafter is the target's own MTP layer)."]

    code, out = validate(tmp_path, mtp["no_mtp"])
    assert code == 1 and any("num_nextn_predict_layers 1, but the weights hold no model.layers.3.eh_proj.weight" in e
                             and "use method ngram or draft_model" in e for e in out["errors"]), out["errors"]
    code, out = validate(tmp_path, models["target"], parallel={"enable_expert_parallel": False})
    assert code == 1 and any("config.json sets no num_nextn_predict_layers: use method ngram or draft_model" in e
                             for e in out["errors"]), out["errors"]


def test_validate_config_table(tmp_path, models, mtp, monkeypatch):
    from specdp_cli import cli

    monkeypatch.setattr(cli.stdout, "width", 400)          # a cell's sentence on one line
    code, text = validate(tmp_path, mtp["lora"], json_out=False)
    assert code == 0 and "MTP layer model.layers.3.* in the target's checkpoint" in text
    assert "OK: policy dummy, dp_sync always, drafter limit D = 64" in text
    code, text = validate(tmp_path, mtp["no_mtp"], json_out=False)
    assert code == 1 and "1 error(s)" in text and "use method ngram or draft_model" in text
