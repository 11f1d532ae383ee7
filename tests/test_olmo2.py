"""OLMo-2 targets (post-norm layers without input norms, q/k RMSNorms over the whole projection, grouped-query
attention) and OLMo-3 (the same with sliding-window layers and per-layer-type rotary tables) on specdp's decoder:
logits and greedy float32 tokens equal transformers', with and without speculation, sequences reaching M;
preflight accepts them and unsupported configs are refused."""
import json
from pathlib import Path

import pytest
import torch

from engine_util import (check_against_reference, load_cpu, make_config, make_engine, prefill_logits,
                         prompts_of_lengths, run_engine, transformers_logits)

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]
HIDDEN = 64


def make_olmo2_dir(path: Path, tokenizer_dir: Path, seed: int, layers: int = 2, kv_heads: int = 4,
                   olmo3: bool = False, **config_extra) -> Path:
    """A random Olmo2ForCausalLM (Olmo3ForCausalLM with `olmo3`) saved with the tokenizer; its norms' weights
    random around 1 (transformers initializes them to ones: a norm read in the wrong place or the wrong shape
    must show)."""
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    name = "Olmo3" if olmo3 else "Olmo2"
    config = getattr(transformers, name + "Config")(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=HIDDEN * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                         pad_token_id=1, **config_extra)
    torch.manual_seed(seed)
    model = getattr(transformers, name + "ForCausalLM")(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 3.0 / HIDDEN ** 0.5)
        model.get_input_embeddings().weight.normal_(0, 1.0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("olmo2")
    tok = models["tokenizer"]
    return {"mha": make_olmo2_dir(root / "mha", tok, seed=5, layers=3),
            "gqa": make_olmo2_dir(root / "gqa", tok, seed=6, kv_heads=2, attention_bias=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
            # sliding layers (window 16) before and after a full one; each type with its own rope (yarn: full)
            "olmo3": make_olmo2_dir(root / "olmo3", tok, seed=7, layers=3, kv_heads=2, olmo3=True, sliding_window=16,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                    rope_parameters={
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0,
                                                           "factor": 2.0, "original_max_position_embeddings": 256}})}


@pytest.mark.parametrize("variant", ["mha", "gqa", "olmo3"])
def test_logits_equal_transformers(olmo2, variant):
    """One prefill of 40 tokens over three cache blocks: every position's logits."""
    torch.set_num_threads(1)
    model = load_cpu(olmo2[variant])
    layer = model.layers[0]
    assert layer.in_norm is None and layer.mlp_norm is None and layer.qk_norm_whole
    assert layer.q_norm.shape == (4 * 16,) and layer.k_norm.shape == (model.KV * 16,)
    ids = torch.tensor(prompts_of_lengths([40], seed=8)[0])
    torch.testing.assert_close(prefill_logits(model, ids), transformers_logits(olmo2[variant], ids), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("variant,method", [("mha", "none"), ("gqa", "draft_model"), ("gqa", "ngram"),
                                            ("olmo3", "none"), ("olmo3", "draft_model")])
def test_greedy_equals_reference(models, olmo2, variant, method):
    M = 64
    cfg, plan = make_config(olmo2[variant], models["draft"] if method == "draft_model" else None, method=method,
                            k=3, M=M, max_num_seqs=4, max_batched=24)
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=6)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(olmo2[variant], done, prompts, 30, M, f"{variant} {method}")


def test_config_and_kv_shapes(olmo2):
    """config.json takes the fast path and every field the loader reads equals transformers' value; preflight's
    KV shapes (from config.json, before loading) are what the loaded model caches."""
    from transformers import AutoConfig

    from specdp_cli.runtime.models import config as hf_config, loader
    from specdp_cli.runtime.models.registry import family_of
    from test_hf_config import Recorder

    path = olmo2["gqa"]
    config = json.loads((path / "config.json").read_text())
    fam = family_of(config)
    assert fam.architecture == "Olmo2ForCausalLM"
    fast = hf_config.from_json(config, fam)
    assert fast is not None, "a config Hugging Face wrote must take the fast path"
    seen = Recorder(fast)
    real = loader.load_config
    loader.load_config = lambda p, c, f: seen
    try:
        model = load_cpu(path)
    finally:
        loader.load_config = real
    ref = AutoConfig.from_pretrained(str(path))
    assert seen.read
    for name in seen.read:
        assert hasattr(fast, name) == hasattr(ref, name), name
        if hasattr(ref, name):
            assert getattr(fast, name) == getattr(ref, name), name
    assert fam.kv_shapes(config) == model.kv_shapes() == [((2, 16), (2, 16))] * 2


def test_unsupported_configs_are_refused(olmo2):
    from specdp_cli.modeldir import architecture_of
    from specdp_cli.runtime.models.registry import UnsupportedModel

    config = json.loads((olmo2["mha"] / "config.json").read_text())
    assert architecture_of(config) == "Olmo2ForCausalLM"
    with pytest.raises(UnsupportedModel, match="hidden_act 'gelu' is not supported for this family"):
        architecture_of({**config, "hidden_act": "gelu"})
    config = json.loads((olmo2["olmo3"] / "config.json").read_text())
    assert architecture_of(config) == "Olmo3ForCausalLM"
    with pytest.raises(UnsupportedModel, match="hidden_act 'relu' is not supported for this family"):
        architecture_of({**config, "hidden_act": "relu"})
    for rope in ({"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                 {"rope_type": "longrope", "rope_theta": 1e4}):
        with pytest.raises(UnsupportedModel, match="is not supported for OLMo-3 .its tables change with"):
            architecture_of({**config, "rope_parameters": rope})


def test_olmo3_layers(olmo2):
    """Sliding layers get the window and their own rotary tables; the full layer the model's (yarn)."""
    model = load_cpu(olmo2["olmo3"])
    assert [layer.window for layer in model.layers] == [16, None, 16]
    assert model.layers[1].rope is None and model.layers[0].rope is model.layers[2].rope
    assert not torch.equal(model.layers[0].rope[0], model.cos)
