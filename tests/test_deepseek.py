"""DeepSeek-V3 targets on specdp's decoder: latent attention (with and without a query LoRA rank, interleaved
and plain rotary pairs, yarn's attention scale), dense layers before sigmoid-routed experts with group-limited
choice, a correction bias and a shared expert. Logits equal transformers' and greedy float32 output equals
it token for token, with and without a drafter; with the routed experts split over 2 or 3 ranks the outputs
equal one rank's."""

import pytest
import torch

from dp_util import HARD_TIMEOUT_S, expert_parallel_job, generate_args, lockstep_run_equals_dp1, selected
from engine_util import (check_against_reference, load_cpu, make_config, make_engine, prefill_logits,
                         prompts_of_lengths, run_engine, transformers_logits)
from helpers import make_deepseek_dir

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, models):
    """lora: q_lora_rank 32, interleaved rotary pairs; plain: q_proj, rotate-half pairs; yarn: q_proj,
    interleaved pairs, yarn rope whose mscale_all_dim changes the attention scale; many: 32 routed experts in 4
    groups, the top 4 from the best 2 groups (each forward runs only the chosen experts)."""
    root = tmp_path_factory.mktemp("deepseek")
    tok = models["tokenizer"]
    return {"lora": make_deepseek_dir(root / "lora", tok, seed=3),
            "plain": make_deepseek_dir(root / "plain", tok, q_lora_rank=None, rope_interleave=False, seed=4),
            "yarn": make_deepseek_dir(root / "yarn", tok, q_lora_rank=None, seed=5, rope_parameters=YARN),
            "many": make_deepseek_dir(root / "many", tok, seed=6, experts=32, top_k=4, n_group=4, topk_group=2)}


@pytest.mark.parametrize("variant", ["lora", "plain", "yarn", "many"])
def test_logits_equal_transformers(deepseek, variant):
    """One prefill of 40 tokens over three cache blocks: every position's logits."""
    torch.set_num_threads(1)
    model = load_cpu(deepseek[variant])
    ids = torch.tensor(prompts_of_lengths([40], seed=8)[0])
    torch.testing.assert_close(prefill_logits(model, ids), transformers_logits(deepseek[variant], ids), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("variant,method", [("lora", "none"), ("lora", "draft_model"), ("plain", "none"),
                                            ("plain", "draft_model"), ("yarn", "none"), ("many", "draft_model")])
def test_greedy_equals_reference(models, deepseek, variant, method):
    M = 64
    cfg, plan = make_config(deepseek[variant], models["draft"], method=method, k=3, M=M, max_num_seqs=4,
                            max_batched=24)
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=6)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(deepseek[variant], done, prompts, 30, M, variant)


def test_kv_shapes_known_before_loading(deepseek):
    """Preflight sizes the KV pool from config.json: the loaded model caches exactly that."""
    from specdp_cli.modeldir import ModelDir

    for target in deepseek.values():
        shapes = ModelDir.open(str(target), "model").kv_shapes()
        assert shapes == load_cpu(target).kv_shapes() == [((4, 24), (4, 16))] * 3


def test_each_rank_reads_only_its_experts(deepseek):
    """Routed experts split (3 ranks, 4 experts: 2 + 1 + 1); the router, its bias and the shared expert whole
    on every rank; the first layer dense; the multi-token-prediction layer (model.layers.3.*) never read."""
    from types import SimpleNamespace

    from specdp_cli.modeldir import ModelDir
    from specdp_cli.runtime.models.weights import read_weights, weights_of

    for rank, want in ((0, range(2)), (1, range(2, 3)), (2, range(3, 4))):
        m = load_cpu(deepseek["lora"], ep=SimpleNamespace(world=3, rank=rank))
        assert m.layers[0].moe is None and m.layers[0].gate_up.shape == (256, 64)
        for layer in m.layers[1:]:
            moe = layer.moe
            assert moe.experts == want and moe.gate_up.shape[0] == moe.down.shape[0] == len(want)
            assert moe.route.router.shape == (4, 64) and moe.route.router.dtype == torch.float32
            assert moe.route.bias.shape == (4,) and moe.route.bias.abs().sum() > 0
            assert moe.shared_gate_up.shape == (64, 64) and moe.shared_down.shape == (64, 32)
    md = ModelDir.open(str(deepseek["lora"]), "model")
    assert any(name.startswith("model.layers.3.") for name in md.tensor_headers)
    names = set(read_weights(md.weight_files, torch.device("cpu"), weights_of(range(3), {2})))
    assert not any(name.startswith("model.layers.3.") for name in names)
    assert {n for n in names if ".experts." in n} == {f"model.layers.{i}.mlp.experts.2.{w}_proj.weight"
                                                      for i in (1, 2) for w in ("gate", "up", "down")}
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in names


def test_loaded_share_counts_held_experts_and_the_mtp_layer(deepseek):
    """Preflight's weight bytes per rank: routed experts (not the shared one) scaled by the share a rank holds,
    the MTP layer (model.layers.3.*) counted only for method mtp."""
    from specdp_cli.modeldir import ModelDir, _numel

    md = ModelDir.open(str(deepseek["lora"]), "model")
    sizes = {n: _numel(shape) for n, (_, shape) in md.tensor_headers.items()}
    total = sum(sizes.values())
    mtp = sum(v for n, v in sizes.items() if n.startswith("model.layers.3."))
    routed = sum(v for n, v in sizes.items() if ".mlp.experts." in n and not n.startswith("model.layers.3."))
    routed_mtp = sum(v for n, v in sizes.items() if ".mlp.experts." in n and n.startswith("model.layers.3."))
    assert md.num_experts == 4 and md.mtp_layers == 1 and mtp > 0
    assert md.loaded_share() == pytest.approx((total - mtp) / total)
    assert md.loaded_share(experts_held=0.5) == pytest.approx((total - mtp - routed / 2) / total)
    assert md.loaded_share(mtp=True, experts_held=0.5) == pytest.approx((total - (routed + routed_mtp) / 2) / total)


def test_expert_parallel_preflight(models, deepseek):
    from specdp_cli.config import validate
    from specdp_cli.preflight import run_preflight

    report = run_preflight(validate({"model": str(deepseek["lora"]), "max_model_len": 64, "device": "cpu",
                                     "speculative": {"model": str(models["draft"])},
                                     "parallel": {"data_parallel_size": 2, "enable_expert_parallel": True}}))
    assert report.ok, report.errors
    assert report.plan.expert_parallel and report.plan.dp_sync == "always" and report.plan.policy == "dummy"
    rows = {c.name: c.detail for c in report.checks}
    assert "DeepseekV3ForCausalLM" in rows["files"]
    assert "4 experts per layer over 2 ranks (rank 0: 2, rank 1: 2)" in rows["parallel"]
    assert "per rank (experts split)" in rows["memory"]


def test_fp8_without_block_scales_is_refused():
    """DeepSeek-V3's published weights are block-scaled FP8 (read: tests/test_fp8.py); FP8 without a
    weight_block_size (per-tensor scales) is refused by name, not loaded as garbage."""
    from specdp_cli.modeldir import UnsupportedModel, architecture_of

    with pytest.raises(UnsupportedModel, match="FP8 checkpoints without weight_block_size"):
        architecture_of({"architectures": ["DeepseekV3ForCausalLM"], "quantization_config": {"quant_method": "fp8"}})
    assert architecture_of({"architectures": ["DeepseekV3ForCausalLM"],
                            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                    "activation_scheme": "dynamic"}}) == "DeepseekV3ForCausalLM"


@pytest.fixture(scope="module", autouse=True)
def deepseek_jobs(request, tmp_path_factory, models, launches) -> dict:
    """The launched tests' commands, started when this module starts (while the in-process tests run):
    {dp: (run directory, input, config, dp 1 reference config)}."""
    jobs = {}
    for p in selected(request, "test_expert_parallel_equals_dp1"):
        tmp = tmp_path_factory.mktemp("deepseek_job")
        target = request.getfixturevalue("deepseek")["many"]
        inp, ref, cfg = expert_parallel_job(tmp, models, target, p["dp"], p["method"])
        jobs[p["dp"]] = (tmp, inp, cfg, ref)
        launches.start(p["dp"], *generate_args(tmp, inp, cfg))
    return jobs


@pytest.mark.timeout(HARD_TIMEOUT_S * 3)
@pytest.mark.parametrize("dp,method", [(2, "draft_model"), (3, "ngram")])
def test_expert_parallel_equals_dp1(deepseek_jobs, launches, dp, method):
    """The routed experts split over the ranks (32 experts, top 4 of the best 2 of 4 groups: 16 + 16, or 11 + 11
    + 10), the shared expert on every rank added once: the outputs of one rank holding every expert."""
    tmp_path, inp, cfg, ref = deepseek_jobs[dp]
    assert len(lockstep_run_equals_dp1(tmp_path, inp, cfg, ref, launched=lambda: launches.result(dp))) == dp
