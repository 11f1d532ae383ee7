"""GPT-OSS targets on specdp's decoder: attention sinks, biased q/k/v/o, alternating sliding-window (8, shorter
than the prompts) and full layers, yarn and default rope, a biased top-k-then-softmax router and biased experts
(gate and up interleaved, the clamped SwiGLU, its clamp reached). Logits equal transformers' and greedy
float32 output equals it token for token, without a drafter, with a drafter model and with n-grams; under
expert parallelism a rank holds only its experts; MXFP4 checkpoints are refused by name."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine_util import check_against_reference, load_cpu, make_config, make_engine, prompts_of_lengths, run_engine

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]
YARN = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


def make_gpt_oss_dir(path: Path, tokenizer_dir: Path, rope: dict, seed: int, layers: int = 2, experts: int = 4,
                     hidden: int = 64, peaked: float = 3.0, limit: float = 1.0) -> Path:
    """A random GPT-OSS (4 heads of 16, 2 kv heads, window 8, sliding and full layers alternating, 4 experts,
    top 2) with every bias and sink random, saved with the tokenizer; `peaked` scales the LM head."""
    from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = GptOssConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                       num_local_experts=experts, num_experts_per_tok=2, swiglu_limit=limit,
                       max_position_embeddings=512, rope_parameters=dict(rope), tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).float()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, peaked / hidden ** 0.5)
        model.get_input_embeddings().weight.normal_(0, 1.0)
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            for proj in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                proj.weight.normal_(0, 0.1)          # attention that depends on position
                proj.bias.normal_(0, 0.1)
            a.sinks.normal_(0, 1.0)
            m.router.weight.normal_(0, 1.0)          # a router that prefers different experts for different tokens
            m.router.bias.normal_(0, 0.5)
            m.experts.gate_up_proj.normal_(0, 0.15)  # gate and up reach the clamp (swiglu_limit 1)
            m.experts.gate_up_proj_bias.normal_(0, 0.3)
            m.experts.down_proj.normal_(0, 0.15)
            m.experts.down_proj_bias.normal_(0, 0.1)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("gpt_oss")
    return {"yarn": make_gpt_oss_dir(root / "yarn", models["tokenizer"], YARN, seed=3),
            "default": make_gpt_oss_dir(root / "default", models["tokenizer"], DEFAULT, seed=4)}


@pytest.mark.parametrize("variant", ["yarn", "default"])
def test_logits_equal_transformers(gpt_oss, variant):
    """One prefill of 40 tokens over three cache blocks (past the window): every position's logits; the
    swiglu clamp was reached on both sides."""
    from transformers import AutoModelForCausalLM

    from specdp_cli.runtime.kv_cache import allocate_kv
    from specdp_cli.runtime.ops import AttnMeta

    torch.set_num_threads(1)
    model = load_cpu(gpt_oss[variant])
    assert [layer.window for layer in model.layers] == [8, None]
    allocate_kv(model, num_blocks=4, block_size=16)
    n = 40
    ids = torch.tensor(prompts_of_lengths([n], seed=8)[0])
    meta = AttnMeta(positions=torch.arange(n), slot_mapping=torch.arange(n) + 16,
                    block_table=torch.tensor([[1, 2, 3, 0]], dtype=torch.int32), T=n)
    ref = AutoModelForCausalLM.from_pretrained(str(gpt_oss[variant]), dtype=torch.float32).eval()
    gate_up = []
    hook = ref.model.layers[0].mlp.experts.register_forward_hook(
        lambda mod, args, out: gate_up.append(args[0] @ mod.gate_up_proj + mod.gate_up_proj_bias[:, None]))
    with torch.no_grad():
        want = ref(ids.view(1, -1)).logits[0]
        torch.testing.assert_close(model.logits(model.forward(ids, meta)), want, rtol=1e-5, atol=1e-5)
    hook.remove()
    g = gate_up[0]
    assert (g[..., ::2] > 1).any() and (g[..., 1::2] > 1).any() and (g[..., 1::2] < -1).any()


@pytest.mark.parametrize("variant,method", [("yarn", "none"), ("yarn", "draft_model"), ("yarn", "ngram"),
                                            ("default", "draft_model")])
def test_greedy_equals_reference(models, gpt_oss, variant, method):
    M = 64
    cfg, plan = make_config(gpt_oss[variant], models["draft"], method=method, k=3, M=M, max_num_seqs=4,
                            max_batched=24, speculative={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=6)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(gpt_oss[variant], done, prompts, 30, M, f"{variant} {method}")
    if method != "none":
        assert engine.counters.spec.num_drafts > 0


def test_kv_shapes_and_experts_known_before_loading(gpt_oss):
    """Preflight sizes the KV pool and counts experts from config.json: the loaded model matches."""
    from specdp_cli.modeldir import ModelDir

    md = ModelDir.open(str(gpt_oss["yarn"]), "model")
    assert md.kv_shapes() == load_cpu(gpt_oss["yarn"]).kv_shapes() == [((2, 16), (2, 16))] * 2
    assert md.num_experts == 4


def test_each_rank_reads_only_its_experts(gpt_oss):
    """Experts split over 2 ranks (4 experts: 2 + 2): rank 1 holds experts 2 and 3 (gate and up de-interleaved,
    in F.linear's layout), the router and its bias whole."""
    from safetensors.torch import load_file

    w = load_file(str(gpt_oss["yarn"] / "model.safetensors"))
    m = load_cpu(gpt_oss["yarn"], ep=SimpleNamespace(world=2, rank=1))
    for i, layer in enumerate(m.layers):
        moe, p = layer.moe, f"model.layers.{i}.mlp."
        assert moe.experts == range(2, 4) and moe.gate_up.shape == (2, 128, 64) and moe.down.shape == (2, 64, 64)
        assert moe.route.router.shape == (4, 64) and moe.route.bias.shape == (4,)
        gate_up, bias = w[p + "experts.gate_up_proj"], w[p + "experts.gate_up_proj_bias"]
        assert torch.equal(moe.gate_up[1], torch.cat([gate_up[3, :, ::2], gate_up[3, :, 1::2]], -1).T)
        assert torch.equal(moe.gate_up_bias[0], torch.cat([bias[2, ::2], bias[2, 1::2]]))
        assert torch.equal(moe.down[0], w[p + "experts.down_proj"][2].T)
        assert torch.equal(moe.down_bias, w[p + "experts.down_proj_bias"][2:])
        assert moe.ep is not None


def test_mxfp4_is_refused_by_name(gpt_oss):
    from specdp_cli.modeldir import UnsupportedModel, architecture_of

    config = json.loads((gpt_oss["yarn"] / "config.json").read_text())
    assert architecture_of(config) == "GptOssForCausalLM"
    mxfp4 = {**config, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}}
    with pytest.raises(UnsupportedModel, match="MXFP4 weights .* not supported yet; give bfloat16 or float32"):
        architecture_of(mxfp4)
    with pytest.raises(UnsupportedModel, match="layer_types"):
        architecture_of({**config, "layer_types": ["sliding_attention", "chunked_attention"]})
