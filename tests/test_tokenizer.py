"""Tokenizers load as the class their tokenizer_config.json names, without AutoTokenizer (whose auto-model
machinery costs seconds of start-up in some transformers releases) — and give what AutoTokenizer gives."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdp_cli.modeldir import _load_tokenizer, _named_tokenizer_class

DEMO = Path(__file__).resolve().parent.parent / "demo" / "pair" / "target"
TEXTS = ["def foo(x):\n    return x + 1  # héllo", "", "  spaces\tand\nnewlines  ", "<|endoftext|> after a special"]


def same_tokenizer(a, b) -> None:
    assert type(a) is type(b) and len(a) == len(b)
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (b.bos_token_id, b.eos_token_id, b.pad_token_id)
    assert a.chat_template == b.chat_template
    for t in TEXTS:
        ids = a(t)["input_ids"]
        assert ids == b(t)["input_ids"]
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("which", ["demo", "fixture"])
def test_named_class_equals_auto_tokenizer(models, which):
    from transformers import AutoTokenizer

    path = str(DEMO if which == "demo" else models["tokenizer"])
    assert _named_tokenizer_class(path) is not None
    same_tokenizer(_load_tokenizer(path), AutoTokenizer.from_pretrained(path))


def test_unknown_or_remote_class_falls_back_to_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    for extra in ({"tokenizer_class": "NoSuchTokenizer"}, {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}):
        d = tmp_path / next(iter(extra))
        shutil.copytree(DEMO, d, ignore=shutil.ignore_patterns("*.safetensors"))
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **extra}))
        assert _named_tokenizer_class(str(d)) is None
        if "tokenizer_class" in extra:
            (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "TokenizersBackend"}))
            same_tokenizer(_load_tokenizer(str(d)), AutoTokenizer.from_pretrained(str(d)))


def test_loading_skips_auto_tokenizer():
    code = ("import sys; from specdp_cli.modeldir import load_tokenizer; load_tokenizer(sys.argv[1]); "
            "print('transformers.models.auto.tokenization_auto' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(DEMO)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
