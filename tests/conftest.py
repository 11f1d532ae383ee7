import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from helpers import build_tokenizer, make_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    """A shared set of tiny model directories: tokenizer, target, drafter (Llama)."""
    root = tmp_path_factory.mktemp("models")
    tok = root / "tokenizer"
    build_tokenizer(tok)
    return {
        "root": root,
        "tokenizer": tok,
        "target": make_model_dir(root / "target", tok, layers=2, seed=1),
        "draft": make_model_dir(root / "draft", tok, layers=1, hidden=32, heads=2, kv_heads=1, seed=2),
    }
