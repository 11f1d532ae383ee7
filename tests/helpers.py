"""Tiny model directories built by the tests themselves (random weights, a small BPE tokenizer)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
DEMO_PAIR = REPO / "demo" / "pair"

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main(sys.argv)\n",
    "while True:\n    line = input()\n    if not line:\n        break\n",
    "The quick brown fox jumps over the lazy dog. 0123456789 {}[]()<>!?;:'\"",
]


def build_tokenizer(path: Path, vocab_size: int = 320, extra: str = ""):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((CORPUS + [extra]) * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|pad|>", unk_token=None)
    fast.save_pretrained(str(path))
    return fast


def make_model_dir(path: Path, tokenizer_dir: Path | None = None, family: str = "llama", hidden: int = 64,
                   layers: int = 2, heads: int = 4, kv_heads: int = 2, max_pos: int = 512, vocab: int | None = None,
                   seed: int = 0, peaked: float = 3.0, eos: int | None = None, copy_of: Path | None = None,
                   **config_extra) -> Path:
    """A random causal LM saved as a Hugging Face directory, with the tokenizer copied in.

    `peaked` scales the output embedding so logits are far apart: float32 rounding then never
    flips an argmax between differently-shaped (but equal) computations."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir else None
    V = vocab or (len(tok) if tok is not None else 320)
    torch.manual_seed(seed)
    if copy_of is not None:
        model = LlamaForCausalLM.from_pretrained(str(copy_of)) if family == "llama" else Qwen2ForCausalLM.from_pretrained(str(copy_of))
    else:
        cls, cfg_cls = (LlamaForCausalLM, LlamaConfig) if family == "llama" else (Qwen2ForCausalLM, Qwen2Config)
        cfg = cfg_cls(vocab_size=V, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=hidden * 2, max_position_embeddings=max_pos,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=eos if eos is not None else 0,
                      pad_token_id=1, **config_extra)
        model = cls(cfg)
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0, peaked / hidden ** 0.5)
            model.get_input_embeddings().weight.normal_(0, 1.0)
    model.save_pretrained(str(path))
    if tok is not None:
        tok.save_pretrained(str(path))
    return path


def write_config(path: Path, data: dict) -> Path:
    path = Path(path)
    if path.suffix == ".toml":
        path.write_text(_to_toml(data))
    else:
        path.write_text(yaml.safe_dump(data))
    return path


def _to_toml(data: dict, prefix: str = "") -> str:
    scalars, tables = [], []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            scalars.append(f"{k} = {json.dumps(v)}")
    out = "\n".join(scalars) + "\n"
    for k, v in tables:
        name = f"{prefix}{k}"
        out += f"\n[{name}]\n" + _to_toml(v, prefix=name + ".")
    return out


def set_config_json(model_dir: Path, **updates) -> None:
    p = Path(model_dir) / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(updates)
    p.write_text(json.dumps(cfg))


def set_eos(model_dir: Path, eos: int) -> None:
    """Make `eos` the model's end-of-sequence token (config and generation config)."""
    set_config_json(model_dir, eos_token_id=eos)
    gen = Path(model_dir) / "generation_config.json"
    g = json.loads(gen.read_text()) if gen.exists() else {}
    g["eos_token_id"] = eos
    gen.write_text(json.dumps(g))


def cpu_threads() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
