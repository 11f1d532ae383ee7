"""The prompt sets of the benchmarks, from a pair directory's held-out prompts, and the training corpus
of the scripts that train drafters and demo models for a pair."""
from __future__ import annotations

import importlib.util
import json
import os


def heldout(pair: str) -> list[str]:
    return [json.loads(line)["prompt"] for line in open(os.path.join(pair, "heldout_prompts.jsonl"))]


def cut_prompts(pair: str, cuts: int, n: int | None = None) -> list[str]:
    """Each held-out prompt cut at `cuts` points (1/cuts .. full), so prompt lengths vary; the first n."""
    out = []
    for text in heldout(pair):
        for c in range(1, cuts + 1):
            out.append(text[: max(80, len(text) * c // cuts)])
    return out[:n] if n else out


def cut_prompt_ids(pair: str, cuts: int, n: int | None = None) -> list[list[int]]:
    """`cut_prompts`, tokenized with the pair's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    return [tok(t)["input_ids"] for t in cut_prompts(pair, cuts, n)]


def training_corpus(corpus_py: str, tok, tiny: bool, device):
    """(train ids, held-out ids) as int32 tensors on `device`: the corpus split of the pair's training script
    (`corpus_py`, a train_pair.py defining corpus_files and encode_corpus) encoded with `tok`; `tiny`: a small
    slice (a dry run)."""
    spec = importlib.util.spec_from_file_location("train_pair", corpus_py)
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    files, held = corpus.corpus_files(2e6 if tiny else 200e6)
    return (corpus.encode_corpus(tok, files[:100] if tiny else files, device),
            corpus.encode_corpus(tok, held[:20] if tiny else held, device))
