"""Mixture-of-experts targets (Mixtral, Qwen3-MoE with a dense layer among sparse ones) on specdp's
decoder: greedy float32 output equals transformers' token for token, with and without a drafter,
sequences reaching M; with dp 2 preflight puts the ranks in lockstep and the outputs equal dp 1."""
import json

import pytest

from dp_util import (HARD_TIMEOUT_S, dp_config, expert_parallel_job, generate_args, lockstep_run_equals_dp1, read_out,
                     selected, text_rows, write_jsonl)
from engine_util import check_against_reference, eos_variant, make_config, make_engine, prompts_of_lengths, run_engine
from helpers import make_moe_dir

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]


@pytest.fixture(scope="module")
def moe(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("moe")
    """Many more experts than each token uses (only the chosen ones run): Mixtral 32, top 2; Qwen3-MoE 64, top 8,
    with a dense layer among the sparse ones."""
    return {"mixtral": make_moe_dir(root / "mixtral", models["tokenizer"], "mixtral", seed=9, experts=32),
            "qwen3_moe": make_moe_dir(root / "qwen3moe", models["tokenizer"], "qwen3_moe", seed=5, experts=64, top_k=8,
                                      mlp_only_layers=[1], norm_topk_prob=True)}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("method", ["none", "draft_model"])
def test_greedy_equals_reference(models, moe, family, method):
    M = 64
    cfg, plan = make_config(moe[family], models["draft"], method=method, k=3, M=M, max_num_seqs=4, max_batched=24)
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=6)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(moe[family], done, prompts, 30, M, family)


@pytest.fixture(scope="module", autouse=True)
def moe_jobs(request, tmp_path_factory, models, launches) -> dict:
    """Every selected launched test's command, and the server test's server, started when this module starts (two
    at a time while the in-process tests run): {key: (run directory, input, config, dp 1 reference config or None)}
    and the server's {"server": (run directory, models, `serving`'s ahead)}."""
    jobs = {}

    def add(key, tmp, inp, cfg, ref=None):
        jobs[key] = (tmp, inp, cfg, ref)
        launches.start(key, *generate_args(tmp, inp, cfg))

    if selected(request, "test_dp2_is_lockstep_and_equals_dp1"):
        tmp = tmp_path_factory.mktemp("moe_job")
        inp = write_jsonl(tmp / "in.jsonl", text_rows(models["tokenizer"], [20, 4, 9, 13], [20, 3, 12, 7], seed=24))
        add("lockstep", tmp, inp, dp_config(tmp, request.getfixturevalue("moe")["mixtral"], models["draft"], dp=2,
                                            dp_sync="auto", k=3, M=64))
    for p in selected(request, "test_expert_parallel_equals_dp1"):
        tmp = tmp_path_factory.mktemp("moe_job")
        inp, ref, cfg = expert_parallel_job(tmp, models, request.getfixturevalue("moe")["qwen3_moe"], p["dp"],
                                            p["method"])
        add(("ep", p["dp"]), tmp, inp, cfg, ref)
    for p in selected(request, "test_expert_parallel_edges_equal_dp1"):
        family, dp, n_short = p["family"], p["dp"], p["n_short"]
        tmp, target = tmp_path_factory.mktemp("moe_job"), request.getfixturevalue("moe_eos")[family]
        rows = text_rows(models["tokenizer"], [30] + SHORT[:n_short], [30, 9, 16, 5, 12][:1 + n_short], seed=22)
        kw = dict(method="draft_model", k=3, M=64, D=40)
        ref = dp_config(tmp, target, models["draft"], dp=1, name="ref.yaml", **kw)
        cfg = dp_config(tmp, target, models["draft"], dp=dp, dp_sync="auto", check=True,
                        parallel={"enable_expert_parallel": True}, **kw)
        add(("edges", family), tmp, write_jsonl(tmp / "in.jsonl", rows), cfg, ref)
    if selected(request, "test_expert_parallel_server_equals_generate"):
        from test_serve import free_port, server_config, start_server_ahead

        tmp, port = tmp_path_factory.mktemp("moe_serve"), free_port()
        served = {**models, "target": request.getfixturevalue("moe")["mixtral"]}
        cfg = server_config(tmp, served, port, parallel={"enable_expert_parallel": True, "dp_sync": "auto"})
        start_server_ahead(request, launches, "server", cfg, port)
        jobs["server"] = (tmp, served, (cfg, port, lambda: launches.result("server")))
    return jobs


@pytest.mark.timeout(HARD_TIMEOUT_S * 2)
def test_dp2_is_lockstep_and_equals_dp1(moe_jobs, launches):
    from specdp_cli.config import load_config
    from specdp_cli.preflight import run_preflight

    tmp_path, inp, cfg, _ = moe_jobs["lockstep"]
    plan = run_preflight(load_config(cfg)).plan
    assert plan.dp_sync == "always" and plan.policy == "dummy"
    ranks = lockstep_run_equals_dp1(tmp_path, inp, cfg, launched=lambda: launches.result("lockstep"))
    assert len({x["steps"] for x in ranks}) == 1


@pytest.mark.timeout(HARD_TIMEOUT_S * 3)
@pytest.mark.parametrize("dp,method", [(2, "draft_model"), (3, "ngram")])
def test_expert_parallel_equals_dp1(moe_jobs, launches, dp, method):
    """The experts split over the ranks (64 experts, top 8: 32 + 32, or 22 + 21 + 21), tokens gathered and
    results reduce-scattered in every MoE forward: the outputs of one rank holding every expert."""
    tmp_path, inp, cfg, ref = moe_jobs[("ep", dp)]
    ranks = lockstep_run_equals_dp1(tmp_path, inp, cfg, ref, launched=lambda: launches.result(("ep", dp)))
    held = [rank["expert_weight_bytes"] for rank in ranks]          # each rank holds its experts only
    assert held == ([held[0]] * 2 if dp == 2 else [held[0], held[0] * 21 // 22, held[0] * 21 // 22]) and held[0] > 0


SHORT = [4, 7, 10, 13]        # prompts that never reach the no-draft window


@pytest.fixture(scope="module")
def moe_eos(tmp_path_factory, moe):
    """Each MoE target with a token it often emits made eos, so some sequences stop early."""
    prompts = prompts_of_lengths([30] + SHORT, seed=22)          # the prompts of the edge-case test below
    return {family: eos_variant(target, prompts, tmp_path_factory.mktemp(f"{family}_eos") / "target")
            for family, target in moe.items()}


@pytest.mark.timeout(HARD_TIMEOUT_S * 2)
# each family once, each dp once (the EP code is the families' shared MoE layer; a pair of launches each)
@pytest.mark.parametrize("family,dp,n_short", [("mixtral", 2, 4), ("qwen3_moe", 3, 1)])
def test_expert_parallel_edges_equal_dp1(moe_jobs, launches, family, dp, n_short):
    """Experts split over the ranks, with a drafter model: one long request crossing the no-draft window
    [38, 63] on one rank only, early stops, and (dp 3, two requests) a rank with no request that runs every
    forward over padding — the tokens of one rank holding every expert."""
    tmp_path, inp, cfg, ref = moe_jobs[("edges", family)]
    ranks = lockstep_run_equals_dp1(tmp_path, inp, cfg, ref, launched=lambda: launches.result(("edges", family)))
    want = read_out(tmp_path / "ref.jsonl")
    long = want[json.dumps("r0")]
    assert long["prompt_tokens"] + long["completion_tokens"] > 40 - 3, "the long request never reached the window"
    if n_short > 1:
        assert any(r["finish_reason"] == "stop" for r in want.values()), "no early stop in the reference"
    assert len({x["steps"] for x in ranks}) == 1 and any(x["padding_steps"] > 0 for x in ranks)
    if dp == 3:
        assert min(x["requests"] for x in ranks) == 0


def test_expert_parallel_preflight(tmp_path, models, moe):
    from specdp_cli.config import validate
    from specdp_cli.preflight import run_preflight

    def report(target, **parallel):
        return run_preflight(validate({"model": str(target), "max_model_len": 64, "device": "cpu",
                                       "speculative": {"model": str(models["draft"])},
                                       "parallel": {"data_parallel_size": 2, "enable_expert_parallel": True,
                                                    **parallel}}))

    ok = report(moe["mixtral"])
    assert ok.ok and ok.plan.dp_sync == "always" and ok.plan.policy == "dummy" and ok.plan.expert_parallel
    rows = {c.name: c.detail for c in ok.checks}
    assert "32 experts per layer over 2 ranks (rank 0: 16, rank 1: 16)" in rows["parallel"]
    assert "per rank (experts split)" in rows["memory"]
    assert any("would hang" in e for e in report(moe["mixtral"], dp_sync="never").errors)
    assert any("needs a mixture-of-experts target" in e for e in report(models["target"]).errors)
    assert any("at least as many experts" in e for e in report(moe["mixtral"], data_parallel_size=33).errors)
    skip = run_preflight(validate({"model": str(moe["mixtral"]), "max_model_len": 64, "device": "cpu",
                                   "speculative": {"model": str(models["draft"]), "policy": "skip"},
                                   "parallel": {"data_parallel_size": 2, "enable_expert_parallel": True}}))
    assert any("would hang" in e for e in skip.errors)


def test_each_rank_reads_only_its_experts(moe):
    import torch
    from types import SimpleNamespace

    from specdp_cli.runtime.models.loader import load_model

    for rank, want in ((0, range(0, 11)), (1, range(11, 22)), (2, range(22, 32))):
        m = load_model(str(moe["mixtral"]), torch.float32, torch.device("cpu"), 64,
                       ep=SimpleNamespace(world=3, rank=rank))
        for layer in m.layers:
            assert layer.moe.experts == want and layer.moe.gate_up.shape[0] == len(want)
            assert layer.moe.route.router.shape[0] == 32         # the router stays whole: every rank routes every token


@pytest.mark.timeout(HARD_TIMEOUT_S * 2)
def test_expert_parallel_server_equals_generate(moe_jobs):
    """Serving with the experts split over 2 ranks: a rank that holds no request still takes part in every
    MoE forward with its padding batch, and completions equal `generate` on one rank with every expert; the
    command shows each rank's "ready in" line."""
    from test_serve import PROMPTS, serving

    tmp, served, ahead = moe_jobs["server"]
    with serving(tmp, served, ahead) as (complete, expected, server):
        assert complete(PROMPTS[:1]) == expected[:1]        # one request: the other rank serves padding only
        assert complete() == expected
        assert server.health() == 200
    shown = server.out + server.err          # the ranks log to a file; the command shows each rank's start-up line
    assert "rank 0 ready in" in shown and "rank 1 ready in" in shown, shown[-2000:]


def test_both_families_are_known_as_moe_before_loading(moe):
    """Preflight (dp_sync auto, expert parallelism, memory) counts experts from config.json by each family's keys:
    transformers 5.24 writes Qwen3-MoE's as num_local_experts, earlier releases as num_experts."""
    import json

    from specdp_cli.modeldir import ModelDir

    for path, n in zip(moe.values(), (32, 64)):
        assert ModelDir.open(str(path), "model").num_experts == n
    config = json.loads((moe["qwen3_moe"] / "config.json").read_text())
    n = config.pop("num_local_experts", None) or config.pop("num_experts")
    for key in ("num_experts", "num_local_experts"):
        assert ModelDir(str(moe["qwen3_moe"]), {**config, key: n}).num_experts == 64


def test_bytes_per_token_are_reported(tmp_path, models, moe):
    """Preflight (table and JSON) and the job summary say what a decoded token reads of the weights: every
    tensor but the routed experts, of which top_k / E, and one embedding row; and what all weights are."""
    from safetensors import safe_open

    from dp_util import run_in_process
    from specdp_cli.config import load_config
    from specdp_cli.preflight import run_preflight

    target = moe["qwen3_moe"]
    total = routed = embed = embed_rows = 0
    for f in target.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                total += t.numel()
                routed += t.numel() if ".experts." in name else 0
                if name.endswith("embed_tokens.weight"):
                    embed, embed_rows = t.numel(), t.shape[0]
    want = {"active_bytes": int((total - routed - embed + routed * 8 / 64 + embed / embed_rows) * 4),
            "total_bytes": total * 4, "routed": "top 8 of 64 experts"}
    cfg = dp_config(tmp_path, target, models["draft"], dp=1, dp_sync="auto", k=3, M=64)
    report = run_preflight(load_config(cfg))
    assert report.plan.memory["weights_per_token"] == want
    assert report.to_json()["weights_per_token"] == want
    assert "A decoded token reads" in {c.name: c.detail for c in report.checks}["memory"]
    inp = write_jsonl(tmp_path / "in.jsonl", text_rows(models["tokenizer"], [9, 5], [4, 6], seed=3))
    run_in_process(cfg, inp, tmp_path / "out.jsonl", "--summary-json", tmp_path / "s.json")
    assert json.load(open(tmp_path / "s.json"))["weights_per_token"] == want
