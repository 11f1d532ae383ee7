"""The decoder's config read from config.json (no transformers import) equals transformers' in every field the
decoder reads, for every family on the fast path; configs the fast path cannot vouch for go to transformers."""
import json

import pytest
import torch

from specdp_cli.runtime.models import config as hf_config, loader
from specdp_cli.runtime.models.registry import families

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 16,
                                                  "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
}


def family_named(model_type):
    return next(f for f in families().values() if f.model_type == model_type)


def save_tiny(path, family):
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, **extra)
    torch.manual_seed(0)
    getattr(transformers, model_cls)(cfg).save_pretrained(str(path))
    return path


class Recorder:
    """A config that notes every attribute read from it."""

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fast_config_reads_what_transformers_gives(tmp_path, monkeypatch, family):
    from transformers import AutoConfig

    path = save_tiny(tmp_path / family, family)
    config = json.loads((path / "config.json").read_text())
    fast = hf_config.from_json(config, family_named(family))
    assert fast is not None, "a config Hugging Face wrote must take the fast path"
    seen = []
    monkeypatch.setattr(loader, "load_config", lambda p, c, f: seen.append(Recorder(fast)) or seen[-1])
    loader.load_model(str(path), torch.float32, torch.device("cpu"), 64)
    ref = AutoConfig.from_pretrained(str(path))
    assert seen[0].read, "load_model read no field"
    for name in seen[0].read:
        assert hasattr(fast, name) == hasattr(ref, name), name
        if hasattr(ref, name):
            assert getattr(fast, name) == getattr(ref, name), name


def test_configs_the_fast_path_cannot_vouch_for(tmp_path):
    config = json.loads((save_tiny(tmp_path / "llama", "llama") / "config.json").read_text())
    assert hf_config.from_json(config, family_named("llama")) is not None
    missing = {k: v for k, v in config.items() if k != "rms_norm_eps"}                 # a default to fill in
    legacy = {**{k: v for k, v in config.items() if k != "rope_parameters"}, "rope_theta": 10000.0}
    scaled = {**config, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    for other in (missing, legacy, scaled):
        assert hf_config.from_json(other, family_named("llama")) is None
    assert hf_config.from_json(config, family_named("deepseek_v3")) is None
    assert hf_config.from_json(config, family_named("qwen3_moe")) is None


def test_loading_a_model_and_its_tokenizer_skips_transformers_auto_classes(models):
    """What a rank loads for a Hugging Face-written Llama directory: no AutoConfig, no AutoTokenizer (their
    auto machinery is seconds of start-up under some transformers releases)."""
    import subprocess
    import sys

    code = ("import sys, torch; import transformers.tokenization_utils_tokenizers; "
            "from specdp_cli.runtime.models.loader import load_model; from specdp_cli.modeldir import load_tokenizer; "
            "load_model(sys.argv[1], torch.float32, torch.device('cpu'), 64); load_tokenizer(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.auto')))")
    out = subprocess.run([sys.executable, "-c", code, str(models["target"])], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
