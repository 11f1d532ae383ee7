"""Turning accepted tokens into output: eos, stop strings, max_tokens and M; the final text."""
from __future__ import annotations

import json
import os

from ..modeldir import load_tokenizer
from .scheduler import Sequence


def eos_ids(tokenizer, model_path: str) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen):
        try:
            with open(gen, encoding="utf-8") as fh:
                e = json.load(fh).get("eos_token_id")
        except (OSError, ValueError):
            e = None
        for x in (e if isinstance(e, list) else [e]):
            if isinstance(x, int):
                ids.add(x)
    return ids


class OutputProcessor:
    def __init__(self, tokenizer_path: str, model_path: str):
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.eos = eos_ids(self.tokenizer, model_path)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def append(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append accepted tokens until a stop; sets seq.finish_reason. Returns the tokens kept."""
        kept = []
        p = seq.req.params
        stops, stop_ids = p.stop, p.stop_token_ids
        for t in tokens:
            if t in self.eos and not p.ignore_eos:
                seq.finish_reason = "stop"
                break
            seq.tokens.append(t)
            kept.append(t)
            if t in stop_ids:                # kept in the sequence, as vLLM keeps a stop token id
                seq.finish_reason = "stop"
                break
            # stop strings wait for min_tokens, as vLLM's do (eos and stop_token_ids are masked until then)
            if stops and len(seq.tokens) - seq.num_prompt >= p.min_tokens and self._stop_hit(seq, stops):
                seq.finish_reason = "stop"
                break
            if seq.L >= seq.limit:
                seq.finish_reason = "length"
                break
        return kept

    def _stop_hit(self, seq: Sequence, stops: list[str]) -> bool:
        # a stop string that just completed lies in the last few tokens (<= 4 bytes per char)
        window = 4 * max(len(s) for s in stops) + 2
        tail = self.decode(seq.generated[-window:])
        if not any(s in tail for s in stops):
            return False
        text = self.decode(seq.generated)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if not hits:
            return False
        seq.stop_text_end = min(hits)
        return True

    def text(self, seq: Sequence) -> str:
        text = self.decode(seq.generated)
        return text[:seq.stop_text_end] if seq.stop_text_end is not None else text
