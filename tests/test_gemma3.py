"""Gemma-3 text targets (Gemma3ForCausalLM) on specdp's decoder: logits and greedy float32 output equal
transformers', with and without speculation, sequences reaching M. The tiny models have random norm weights
(transformers starts them at 0: Gemma's norm is x * (1 + w)), sliding windows (8 and 16) shorter than most
prompts among full-attention layers, local rotary tables of their own, query_pre_attn_scalar != head_dim;
one is tied (Gemma's default), the other has an LM head, linear rope scaling on its global layers and
final-logit softcapping."""
import json
import shutil

import pytest
import torch

from engine_util import (check_against_reference, load_cpu, make_config, make_engine, prefill_logits,
                         prompts_of_lengths, run_engine, transformers_logits)

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]
HIDDEN = 64


def make_gemma3_dir(path, tokenizer_dir, seed: int, **config_extra):
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    kw = dict(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
              max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**kw, **config_extra}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
        model.get_input_embeddings().weight.normal_(0, 3.0 / HIDDEN ** 0.5)     # the LM head too where tied
        if not model.config.tie_word_embeddings:
            model.get_input_embeddings().weight.normal_(0, 1.0)
            model.get_output_embeddings().weight.normal_(0, 3.0 / HIDDEN ** 0.5)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("gemma3")
    local = {"rope_type": "default", "rope_theta": 100.0}
    return {
        # layers: local, local, global, local (Gemma's sliding_window_pattern 3)
        "tied": make_gemma3_dir(root / "tied", models["tokenizer"], seed=5, sliding_window=8,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                             "sliding_attention"],
                                rope_parameters={"sliding_attention": local,
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        "scaled": make_gemma3_dir(root / "scaled", models["tokenizer"], seed=6, sliding_window=16,
                                  tie_word_embeddings=False, final_logit_softcapping=5.0,
                                  layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                               "full_attention"],
                                  rope_parameters={"sliding_attention": local,
                                                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1e4}}),
    }


@pytest.mark.parametrize("variant", ["tied", "scaled"])
def test_logits_equal_transformers(gemma, variant):
    """One prefill of 40 tokens over three cache blocks: every position's logits."""
    torch.set_num_threads(1)
    model = load_cpu(gemma[variant])
    windows = {"tied": [8, 8, None, 8], "scaled": [None, 16, 16, None]}[variant]
    assert [layer.window for layer in model.layers] == windows
    ids = torch.tensor(prompts_of_lengths([40], seed=8)[0])
    torch.testing.assert_close(prefill_logits(model, ids), transformers_logits(gemma[variant], ids), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("variant,method", [("tied", "none"), ("tied", "draft_model"), ("scaled", "ngram")])
def test_greedy_equals_reference(models, gemma, variant, method):
    M = 64
    cfg, plan = make_config(gemma[variant], models["draft"], method=method, k=3, M=M, max_num_seqs=4,
                            max_batched=24, speculative={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=6)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(gemma[variant], done, prompts, 30, M, f"{variant} {method}")
    if method != "none":
        assert engine.counters.spec.num_drafts > 0


def test_kv_shapes_known_before_loading(gemma):
    """Preflight sizes the KV pool from config.json: the loaded model caches exactly that."""
    from specdp_cli.modeldir import ModelDir

    for target in gemma.values():
        assert ModelDir.open(str(target), "model").kv_shapes() == load_cpu(target).kv_shapes() == [((2, 16), (2, 16))] * 4


def test_config_of_older_releases_loads_the_same(tmp_path, gemma):
    """A config.json as transformers 4 wrote it (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern; no layer_types, no rope_parameters) gives the same layers and tables."""
    new = json.loads((gemma["scaled"] / "config.json").read_text())
    old_dir = shutil.copytree(gemma["scaled"], tmp_path / "old")
    old = {k: v for k, v in new.items() if k not in ("layer_types", "rope_parameters", "_sliding_window_pattern")}
    old.update(rope_theta=1e4, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
               sliding_window_pattern=2)          # pattern 2: local, global, local, global
    (old_dir / "config.json").write_text(json.dumps(old))
    a, b = load_cpu(gemma["scaled"]), load_cpu(old_dir)
    assert [layer.window for layer in b.layers] == [16, None, 16, None]
    assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)
    local = a.layers[1].rope
    assert not torch.equal(local[0], a.cos)
    assert all(torch.equal(b.layers[i].rope[0], local[0]) for i in (0, 2)) and b.layers[1].rope is None
    assert b.softcap == 5.0 and b.scale == 24 ** -0.5 and b.embed_scale == 8.0


def test_refusals_say_why(gemma):
    """(make_config in the tests above asserts that preflight accepts both targets.)"""
    from specdp_cli.modeldir import architecture_of
    from specdp_cli.runtime.models.registry import UnsupportedModel

    config = json.loads((gemma["tied"] / "config.json").read_text())
    assert architecture_of(config) == "Gemma3ForCausalLM"
    refused = {
        "attn_logit_softcapping is not supported for Gemma-3": {"attn_logit_softcapping": 50.0},
        "use_bidirectional_attention is not supported": {"use_bidirectional_attention": True},
        "hidden_activation 'gelu' is not supported for Gemma-3": {"hidden_activation": "gelu"},
        "rope type dynamic is not supported for Gemma-3": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        "rope type longrope is not supported for Gemma-3": {
            "rope_parameters": {**config["rope_parameters"], "sliding_attention": {"rope_type": "longrope"}}},
    }
    for why, change in refused.items():
        with pytest.raises(UnsupportedModel, match=why):
            architecture_of({**config, **change})
