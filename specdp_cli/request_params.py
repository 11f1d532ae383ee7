"""The sampling fields of one request — a `generate` input line or an API body — checked once, the
same way for both, with the bounds vLLM applies: integers are integers that fit in 64 bits,
numbers are finite (JSON parsers accept NaN and Infinity), ranges as below. A bad value is the
caller's 400 or error line, never a failed job or a dead rank.

  max_tokens   integer >= 1 (a caller may default it)
  temperature  number >= 0 (0: greedy)
  top_p        number in (0, 1]
  top_k        integer >= -1 (-1 and 0: off)
  seed         integer in [-2**63, 2**63 - 1], or absent
  stop         a string or a list of strings (empty ones are dropped)
  speculative  a boolean (an extension field; false: the request's sequence verifies no drafts), or absent
"""
from __future__ import annotations

import math

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


class ParamError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _int(key: str, v, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ParamError(key, f"{key} must be an integer (got {v!r})")
    if not INT64_MIN <= v <= INT64_MAX:
        raise ParamError(key, f"{key} must fit in 64 bits, i.e. lie in [-2**63, 2**63 - 1] (got {v})")
    if lo is not None and v < lo:
        raise ParamError(key, f"{key} must be >= {lo} (got {v})")
    return v


def _float(key: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ParamError(key, f"{key} must be a number (got {v!r})")
    try:
        f = float(v)
    except OverflowError:
        raise ParamError(key, f"{key} is out of range (got an integer of {len(str(v))} digits)") from None
    if not math.isfinite(f):
        raise ParamError(key, f"{key} must be a finite number (got {v!r})")
    return f


def sampling_defaults(sampling, max_tokens: bool = True) -> dict:
    """The config's `sampling` section as check_sampling's defaults; max_tokens=False leaves
    max_tokens to the caller (the server fills it to the room the prompt leaves)."""
    return {"max_tokens": sampling.max_tokens if max_tokens else None, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": sampling.top_k}


def check_sampling(raw: dict, defaults: dict, max_tokens_key: str = "max_tokens") -> dict:
    """raw: the request's fields (absent or null: the default). defaults: max_tokens (may be None),
    temperature, top_p, top_k. Returns max_tokens, temperature, top_p, top_k (0 when off), seed (None
    or an int64), stop (a list of non-empty strings), and speculative: False when the request opts out.
    Raises ParamError naming the field."""
    def given(key):
        return raw.get(key) is not None

    out = {"max_tokens": defaults.get("max_tokens"), "temperature": float(defaults.get("temperature", 0.0)),
           "top_p": float(defaults.get("top_p", 1.0)), "top_k": int(defaults.get("top_k") or 0), "seed": None,
           "stop": []}
    if given(max_tokens_key):
        out["max_tokens"] = _int(max_tokens_key, raw[max_tokens_key], lo=1)
    if given("temperature"):
        out["temperature"] = t = _float("temperature", raw["temperature"])
        if t < 0:
            raise ParamError("temperature", f"temperature must be >= 0 (got {t})")
    if given("top_p"):
        out["top_p"] = p = _float("top_p", raw["top_p"])
        if not 0 < p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1] (got {p})")
    if given("top_k"):
        out["top_k"] = max(_int("top_k", raw["top_k"], lo=-1), 0)
    if given("seed"):
        out["seed"] = _int("seed", raw["seed"])
    if given("stop"):
        stop = raw["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ParamError("stop", "stop must be a string or a list of strings")
        out["stop"] = [s for s in stop if s]
    if given("speculative"):
        if not isinstance(raw["speculative"], bool):
            raise ParamError("speculative", f"speculative must be true or false (got {raw['speculative']!r})")
        if not raw["speculative"]:
            out["speculative"] = False      # only when off: the fields (and input hashes) of other requests stay as they were
    return out
