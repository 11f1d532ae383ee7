"""Rotary tables: specdp computes them without importing a modeling module (seconds of start-up);
they must equal what each family's own transformers rotary module returns, for every rope type."""
import importlib

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from specdp_cli.runtime.models.rotary import rotary_tables


def module_tables(cfg, model_type: str, arch: str, n: int):
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary = getattr(module, arch.replace("ForCausalLM", "RotaryEmbedding"))(config=cfg)
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1), torch.arange(n).view(1, -1))
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


SMALL = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024)
CASES = [
    ("llama", "LlamaForCausalLM", LlamaConfig(**SMALL, rope_theta=500000.0)),
    ("llama", "LlamaForCausalLM", LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 512})),
    ("llama", "LlamaForCausalLM", LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})),
    ("llama", "LlamaForCausalLM", LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 256})),
    ("llama", "LlamaForCausalLM", LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})),
    ("qwen3", "Qwen3ForCausalLM", Qwen3Config(**SMALL, head_dim=96)),
    ("qwen2", "Qwen2ForCausalLM", Qwen2Config(**SMALL)),
    ("mistral", "MistralForCausalLM", MistralConfig(**SMALL)),
]


@pytest.mark.parametrize("model_type,arch,cfg", CASES, ids=lambda c: getattr(c, "rope_parameters", {}).get("rope_type", c)
                         if not isinstance(c, str) else c)
def test_rotary_tables_equal_the_family_module(model_type, arch, cfg):
    n = 2048          # past max_position_embeddings too (dynamic scaling kicks in there)
    cos, sin = rotary_tables(cfg, model_type, arch, n)
    ref_cos, ref_sin = module_tables(cfg, model_type, arch, n)
    assert cos.shape == ref_cos.shape
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)
