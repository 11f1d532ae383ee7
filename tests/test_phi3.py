"""Phi-3 (Phi3ForCausalLM) on specdp's decoder: fused qkv_proj / gate_up_proj under grouped-query attention,
a partial rotary factor (Phi-4-mini's 0.75) and a sliding window shorter than the prompts. Greedy float32
output equals transformers' token for token, without and with speculation, sequences reaching M."""
import json

import pytest
import torch

from engine_util import (check_against_reference, load_cpu, make_config, make_engine, prefill_logits, prompts_of_lengths,
                         run_engine)

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]
HIDDEN = 64
# "full": every dim of a head rotates, no window; "partial_window": 12 of 16 dims rotate (the factor given in
# rope_parameters only, as transformers 5 stores it) and every layer sees the last 16 positions only
VARIANTS = {
    "full": dict(sliding_window=None),
    "partial_window": dict(sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                              "partial_rotary_factor": 0.75}),
}


def make_phi3_dir(path, tokenizer_dir, seed=0, **extra):
    """A random Phi-3 saved as a Hugging Face directory with the tokenizer: 2 layers, 4 heads of 16 over 2 kv
    heads; weights of std 0.1 make attention depend on position (so the window and the rotation matter)."""
    from transformers import AutoTokenizer, Phi3Config, Phi3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = Phi3Config(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     original_max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
                     bos_token_id=0, eos_token_id=0, pad_token_id=1, **extra)
    torch.manual_seed(seed)
    model = Phi3ForCausalLM(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 3.0 / HIDDEN ** 0.5)
        model.get_input_embeddings().weight.normal_(0, 1.0)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("phi3")
    return {name: make_phi3_dir(root / name, models["tokenizer"], seed=7 + i, **extra)
            for i, (name, extra) in enumerate(VARIANTS.items())}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_equal_transformers(phi3, variant):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = load_cpu(phi3[variant])
    ids = torch.tensor(prompts_of_lengths([40], seed=8)[0])
    ref = AutoModelForCausalLM.from_pretrained(str(phi3[variant]), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(ids.view(1, -1)).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids), want, rtol=1e-5, atol=1e-5)
    if variant == "partial_window":
        # the window and the partial rotation are exercised: without either, the logits change
        assert [layer.window for layer in model.layers] == [16, 16] and model.cos.shape[-1] == 6
        ref.config.sliding_window = None
        ref.model.config.sliding_window = None
        with torch.no_grad():
            unwindowed = ref(ids.view(1, -1)).logits[0]
        torch.testing.assert_close(unwindowed[:16], want[:16], rtol=1e-5, atol=1e-5)
        assert (unwindowed[16:] - want[16:]).abs().max() > 1e-2
    else:
        assert [layer.window for layer in model.layers] == [None, None] and model.cos.shape[-1] == 8


def test_fused_projections_load_unsplit(phi3):
    """qkv_proj is q, k, v rows ((4 + 2 + 2) x 16), gate_up_proj gate then up: both loaded as they are."""
    from safetensors.torch import load_file

    w = load_file(str(phi3["full"] / "model.safetensors"))
    model = load_cpu(phi3["full"])
    layer = model.layers[1]
    assert layer.qkv.shape == (8 * 16, HIDDEN) and layer.gate_up.shape == (4 * HIDDEN, HIDDEN)
    assert torch.equal(layer.qkv, w["model.layers.1.self_attn.qkv_proj.weight"])
    assert torch.equal(layer.gate_up, w["model.layers.1.mlp.gate_up_proj.weight"])
    assert model.kv_shapes() == [((2, 16), (2, 16))] * 2


@pytest.mark.parametrize("method", ["none", "draft_model", "ngram"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_equals_reference(models, phi3, variant, method):
    M = 64
    cfg, plan = make_config(phi3[variant], models["draft"], method=method, k=3, M=M, max_num_seqs=4, max_batched=24,
                            speculative={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=6)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(phi3[variant], done, prompts, 30, M, variant)
    if method != "none":
        assert engine.counters.spec.num_drafts > 0


@pytest.mark.parametrize("extra", [dict(partial_rotary_factor=0.75),
                                   dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                         "partial_rotary_factor": 0.5}),
                                   dict()])
def test_rotary_tables_equal_phi3_module(extra):
    """The partial rotary factor as a config argument (Phi-4-mini's config.json) or in rope_parameters only."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from specdp_cli.runtime.models.rotary import rotary_tables

    cfg = Phi3Config(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024, **extra)
    cos, sin = rotary_tables(cfg, "phi3", "Phi3ForCausalLM", 300)
    with torch.no_grad():
        ref_cos, ref_sin = Phi3RotaryEmbedding(cfg)(torch.zeros(1), torch.arange(300).view(1, -1))
    half = ref_cos.shape[-1] // 2
    assert cos.shape == (300, half)
    torch.testing.assert_close(cos, ref_cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin[0, :, :half], rtol=0, atol=1e-6)


def test_config_fast_path_equals_transformers(phi3, monkeypatch):
    """A config.json Hugging Face wrote takes the fast path and loads what transformers' Phi3Config gives."""
    from specdp_cli.runtime.models import config as hf_config
    from specdp_cli.runtime.models.registry import families

    fam = families()["Phi3ForCausalLM"]
    for target in phi3.values():
        assert hf_config.from_json(json.loads((target / "config.json").read_text()), fam) is not None
        fast = load_cpu(target)
        monkeypatch.setattr(hf_config, "from_json", lambda config, family: None)
        slow = load_cpu(target)
        monkeypatch.undo()
        assert [x.window for x in fast.layers] == [x.window for x in slow.layers]
        assert torch.equal(fast.cos, slow.cos) and torch.equal(fast.sin, slow.sin)


def test_preflight_accepts_and_kv_shapes_known_before_loading(models, phi3):
    from specdp_cli.modeldir import ModelDir

    for target in phi3.values():
        make_config(target, models["draft"], method="draft_model", k=3, M=64)       # asserts preflight's ok
        assert ModelDir.open(str(target), "model").kv_shapes() == load_cpu(target).kv_shapes()


def test_refused_with_a_reason(phi3):
    from specdp_cli.modeldir import architecture_of
    from specdp_cli.runtime.models.registry import UnsupportedModel

    config = json.loads((phi3["full"] / "config.json").read_text())
    assert architecture_of(config) == "Phi3ForCausalLM"
    longrope = {**config, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                              "long_factor": [2.0] * 8, "original_max_position_embeddings": 256}}
    assert architecture_of(longrope) == "Phi3ForCausalLM"
    with pytest.raises(UnsupportedModel, match=r"hidden_act 'gelu' is not supported"):
        architecture_of({**config, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModel, match=r"Phi-3 rope type 'linear' is not supported"):
        architecture_of({**config, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})
