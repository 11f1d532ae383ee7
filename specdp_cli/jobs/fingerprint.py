"""What makes a result what it is, as short hashes, so a rerun reuses a finished line only when the
same job would produce it again.

A job's fingerprint has parts — the target model, the drafter, the tokenizer (each: its real path,
`config.json` and its files' names and sizes; gigabytes are never hashed) and the decoding settings
(method, k, n-gram sizes, the drafter's length limit, dtype, device, max_model_len, seed, graphs) —
so a mismatch can name what changed. What cannot change a token is left out: the data-parallel size,
the scheduler, the KV cache, timeouts, progress options. Each input line adds its own hash (its
prompt token ids and sampling fields, or its raw text when it is an error line).
"""
from __future__ import annotations

import hashlib
import json
import os

from ..config import Config
from ..methods import METHODS
from ..plan import Plan

def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _dir_id(path: str | None) -> str:
    """A model or tokenizer directory: where it is, its config, and its files' names and sizes."""
    if not path:
        return "none"
    real = os.path.realpath(path)
    files = {}
    try:
        for name in sorted(os.listdir(real)):
            full = os.path.join(real, name)
            if os.path.isfile(full):
                files[name] = os.path.getsize(full)
        with open(os.path.join(real, "config.json"), "rb") as fh:
            config = fh.read().decode(errors="replace")
    except OSError:
        config = ""
    return _hash({"path": real, "config": config, "files": files})


def job_parts(cfg: Config, plan: Plan) -> dict[str, str]:
    spec = cfg.speculative
    decoding = {"method": spec.method, "dtype": plan.dtype, "device": plan.device,
                "max_model_len": cfg.max_model_len, "seed": cfg.seed, "enforce_eager": cfg.enforce_eager,
                "chat_template": cfg.chat_template}
    if cfg.parallel.tensor_parallel_size > 1:     # split sums round differently (bf16); left out at 1: old jobs resume
        decoding["tensor_parallel_size"] = cfg.parallel.tensor_parallel_size
    meth = METHODS[spec.method]
    if meth.separate_lm and plan.draft_tensor_parallel_size > 1:    # a split drafter's drafts round differently too
        decoding["draft_tensor_parallel_size"] = plan.draft_tensor_parallel_size
    if meth.drafts:
        decoding["k"] = spec.num_speculative_tokens
        # the step's k changes seeded sampled tokens (rejection sampling draws depend on the drafts)
        if spec.num_speculative_tokens_per_batch_size:
            decoding["k_per_batch_size"] = sorted(map(list, spec.num_speculative_tokens_per_batch_size))
        if spec.adaptive:
            decoding["adaptive"] = True
        decoding["drafter_max_model_len"] = plan.drafter_max_model_len
    if meth.prompt_lookup:
        decoding["ngram"] = [spec.prompt_lookup_min, spec.prompt_lookup_max]
    dirs = {"target model": cfg.model, "drafter": spec.model if meth.loads else None, "tokenizer": cfg.tokenizer_path}
    parts = {name: _dir_id(path) for name, path in dirs.items()}
    parts["decoding settings"] = _hash(decoding)
    # readable beside the hashes (not hashed): what a refusal names when a part changed
    parts[DETAILS] = {"decoding settings": decoding,
                      **{name: os.path.realpath(path) if path else None for name, path in dirs.items()}}
    return parts


DETAILS = "details"


def job_hash(parts: dict) -> str:
    return _hash({k: v for k, v in parts.items() if k != DETAILS})


def input_hash(prompt_ids: list[int], params: dict, raw: str | None = None) -> str:
    return _hash({"prompt_ids": prompt_ids, "params": params} if raw is None else {"raw": raw})


def changed_parts(old: dict | None, new: dict) -> str:
    """What changed between two jobs' parts, as precisely as the old job file allows: 'the decoding settings
    (num_speculative_tokens 4 -> 3)', 'the target model (/a -> /b)', 'the target model (its config.json or
    files)'; a general phrase when the old parts are unknown."""
    if not old:
        return "its configuration"
    names = [k for k in new if k != DETAILS and old.get(k) != new[k]]
    if not names:
        return "its configuration"
    was, now = old.get(DETAILS) or {}, new.get(DETAILS) or {}
    said = [f"the {name} ({_what_changed(name, was.get(name), now.get(name))})" if name in was else f"the {name}"
            for name in names]
    return said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]


_SETTING_NAMES = {"k": "num_speculative_tokens", "k_per_batch_size": "num_speculative_tokens_per_batch_size",
                  "drafter_max_model_len": "the drafter's max_model_len",
                  "ngram": "prompt_lookup_min / prompt_lookup_max"}


def _what_changed(name: str, was, now) -> str:
    if name == "decoding settings" and isinstance(was, dict) and isinstance(now, dict):
        keys = [k for k in {**was, **now} if was.get(k) != now.get(k)]
        return "; ".join(f"{_SETTING_NAMES.get(k, k)} {was.get(k, 'unset')} -> {now.get(k, 'unset')}"
                         for k in keys) or "their values"
    if was != now:
        return f"{was} -> {now}"
    return "its config.json or files"
