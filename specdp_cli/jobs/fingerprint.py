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
    meth = METHODS[spec.method]
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
    return {"target model": _dir_id(cfg.model),
            "drafter": _dir_id(spec.model) if meth.loads else "none",
            "tokenizer": _dir_id(cfg.tokenizer_path),
            "decoding settings": _hash(decoding)}


def job_hash(parts: dict[str, str]) -> str:
    return _hash(parts)


def input_hash(prompt_ids: list[int], params: dict, raw: str | None = None) -> str:
    return _hash({"prompt_ids": prompt_ids, "params": params} if raw is None else {"raw": raw})


def changed_parts(old: dict[str, str] | None, new: dict[str, str]) -> str:
    """'the drafter and the decoding settings', or a general phrase when the old parts are unknown."""
    if not old:
        return "its configuration"
    names = [k for k in new if old.get(k) != new[k]]
    if not names:
        return "its configuration"
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
