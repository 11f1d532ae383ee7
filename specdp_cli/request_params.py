"""The sampling fields of a request, defined once: their names and defaults (`SamplingParams`), their
bounds (`BOUNDS`, JSON-schema fragments: /openapi.json shows them as they are), and the one check of a
request's values (`check_sampling`) — for a `generate` input line, an API body and the config's
`sampling` defaults alike, with the bounds vLLM applies: integers are integers that fit in 64 bits,
numbers are finite (JSON parsers accept NaN and Infinity). A bad value is the caller's 400, error line
or config error naming the field, never a failed job or a dead rank.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


@dataclass
class SamplingParams:
    """What a request asks of sampling (what a rank's engine reads)."""
    max_tokens: int = 128             # tokens to generate at most (the sequence also stops at max_model_len)
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0: off (a request's -1 means off too)
    seed: int = 0                     # a request without one gets one derived from the job's seed and its id
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)   # tokens that end the sequence (kept in it, as vLLM)
    ignore_eos: bool = False          # True: eos does not end the sequence
    speculative: bool = True          # False: the request's rows verify no drafts (an extension field)
    # what changes the target's distribution at every verified position (runtime/logits_process.py)
    min_tokens: int = 0               # eos and stop_token_ids are masked until this many tokens are generated
    min_p: float = 0.0                # tokens below min_p x the most likely one's probability are dropped
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    logprobs: int | None = None       # report each emitted token's log-probability and this many alternatives
    structured_outputs: dict | None = None   # {"grammar": llguidance grammar, "kind": ...} (`check_structured`)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Asks for more than temperature / top-k / top-p / min-p: the target's logits change at every verified
        position (runtime/logits_process.py)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.structured_outputs)

    @classmethod
    def from_dict(cls, p: dict) -> "SamplingParams":
        """From `check_sampling`'s values (a field it leaves out keeps its default). A serving rank makes one for
        every request it takes, inside its step loop: so over the request's few values, not all ~20 fields."""
        return cls(**{k: v for k, v in p.items() if v is not None and k in _FIELD_NAMES})


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


# each field's bounds; a request may leave any out (its default: the config's `sampling` section, else
# SamplingParams'); `seed` may also be null
BOUNDS: dict[str, dict] = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "description": "0: greedy"},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1, "description": "-1 or 0: off"},
    "seed": {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0},
                       "description": "token ids that end the sequence (kept in its token ids, as vLLM keeps them)"},
    "ignore_eos": {"type": "boolean", "description": "true: eos does not end the sequence"},
    "speculative": {"type": "boolean",
                    "description": "specdp extension: false = this request verifies no drafts (others still speculate)"},
    "min_tokens": {"type": "integer", "minimum": 0, "description": "eos and stop_token_ids cannot end the sequence "
                                                                   "before this many tokens"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "description": "1: off"},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                   "description": "token id (as a string) -> bias added to its logit"},
    "logprobs": {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 20}],
                 "description": "completions: how many alternatives to report per token (0..20); chat: true, with "
                                "top_logprobs"},
    "structured_outputs": {"type": "object", "description": "vLLM's structured outputs: exactly one of json (a JSON "
                                                            "schema), regex, choice (a list of strings), grammar "
                                                            "(Lark), json_object (true)"},
}
MAX_LOGPROBS = 20
CONFIGURABLE = ("max_tokens", "temperature", "top_p", "top_k")      # what a config's `sampling` section may default
assert set(BOUNDS) == {f.name for f in fields(SamplingParams)}


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


def _float(key: str, v, bounds: dict) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ParamError(key, f"{key} must be a number (got {v!r})")
    try:
        f = float(v)
    except OverflowError:
        raise ParamError(key, f"{key} is out of range (got an integer of {len(str(v))} digits)") from None
    if not math.isfinite(f):
        raise ParamError(key, f"{key} must be a finite number (got {v!r})")
    if "exclusiveMinimum" in bounds:                     # (lo, hi]
        lo, hi = bounds["exclusiveMinimum"], bounds.get("maximum", math.inf)
        if not lo < f <= hi:
            raise ParamError(key, f"{key} must be in ({lo}, {hi}] (got {f})" if hi < math.inf
                             else f"{key} must be > {lo} (got {f})")
    elif f < bounds["minimum"] or f > bounds.get("maximum", math.inf):
        raise ParamError(key, f"{key} must be in [{bounds['minimum']}, {bounds['maximum']}] (got {f})"
                         if "maximum" in bounds else f"{key} must be >= {bounds['minimum']} (got {f})")
    return f


def _value(key: str, v, name: str):
    """Field `key`'s value `v` (sent as `name`), checked against its bounds and normalised: top_k -1 -> 0,
    stop -> a list of non-empty strings."""
    b = BOUNDS[key]
    if key == "stop":
        stop = [v] if isinstance(v, str) else v
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ParamError(name, "stop must be a string or a list of strings")
        return [s for s in stop if s]
    if key == "stop_token_ids":
        if not isinstance(v, list):
            raise ParamError(name, f"stop_token_ids must be a list of token ids (got {v!r})")
        return sorted({_int(name, t, lo=0) for t in v})
    if key == "logit_bias":
        if not isinstance(v, dict):
            raise ParamError(name, f"logit_bias must be an object of token id -> bias (got {v!r})")
        out = {}
        for t, b in v.items():
            try:
                tid = int(t)
            except ValueError:
                raise ParamError(name, f"logit_bias keys must be token ids (got {t!r})") from None
            out[_int(name, tid, lo=0)] = _float(name, b, {"minimum": -100, "maximum": 100})
        return dict(sorted(out.items()))
    if key == "logprobs":             # completions: an integer; chat: a boolean (its count is top_logprobs)
        if isinstance(v, bool):
            return v
        return min(_int(name, v, lo=0), 10 ** 6)
    if key == "structured_outputs":
        return check_structured(v, name)
    if b["type"] == "boolean":
        if not isinstance(v, bool):
            raise ParamError(name, f"{name} must be true or false (got {v!r})")
        return v
    if b["type"] == "integer":
        n = _int(name, v, lo=b["minimum"] if key != "seed" else None)
        return max(n, 0) if key == "top_k" else n
    return _float(name, v, b)


def sampling_defaults(sampling, max_tokens: bool = True) -> dict:
    """The config's `sampling` section as check_sampling's defaults; max_tokens=False leaves
    max_tokens to the caller (the server fills it to the room the prompt leaves)."""
    out = {k: getattr(sampling, k) for k in CONFIGURABLE}
    if not max_tokens:
        out["max_tokens"] = None
    return out


def check_sampling(raw: dict, defaults: dict) -> dict:
    """raw: the request's fields (absent or null: the default). defaults: the configurable fields'
    (max_tokens may be None). Returns max_tokens, temperature, top_p, top_k (0 when off), seed (None or an
    int64), stop (a list of non-empty strings); the fields that ask for something more (`ASKS`: speculative
    false, stop_token_ids, ignore_eos, min_tokens, min_p, the penalties, logit_bias, logprobs, structured output)
    only when the request asks it (so the fields — and the input hashes — of other requests stay as they were).
    max_completion_tokens, where `check_fields` lets a request give it, stands for max_tokens; chat's
    `logprobs: true` with `top_logprobs` becomes logprobs = top_logprobs; `response_format` and vLLM's
    `guided_*` fields become structured_outputs. Raises ParamError naming the field.
    Which other fields a request may hold: `check_fields`."""
    base = SamplingParams()
    out = {**{k: getattr(base, k) for k in CONFIGURABLE}, **defaults, "seed": None, "stop": []}
    out["top_k"] = max(int(out["top_k"] or 0), 0)
    for key in BOUNDS:
        name = ("max_completion_tokens" if key == "max_tokens" and raw.get("max_completion_tokens") is not None
                else key)
        if raw.get(name) is not None:
            out[key] = _value(key, raw[name], name)
    out["logprobs"] = _logprobs(out.get("logprobs"), raw.get("top_logprobs"))
    structured = [(name, raw[name]) for name in ("structured_outputs", "response_format", *GUIDED)
                  if raw.get(name) is not None and not (name == "response_format" and raw[name] == {"type": "text"})]
    if len(structured) > 1:
        raise ParamError(structured[1][0], f"give one of {structured[0][0]} and {structured[1][0]}, not both")
    if structured and structured[0][0] != "structured_outputs":
        out["structured_outputs"] = check_structured(_as_structured(*structured[0]), structured[0][0])
    for key, asks_nothing in ASKS.items():
        if out.get(key, asks_nothing) == asks_nothing:
            out.pop(key, None)
    return out


# fields a request sets only to ask for something, at the value that asks nothing: kept only when asked
ASKS = {"speculative": True, "stop_token_ids": [], "ignore_eos": False, "min_tokens": 0, "min_p": 0.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {},
        "logprobs": None, "structured_outputs": None}
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")     # vLLM's older names


def _logprobs(v, top) -> int | None:
    """Completions' `logprobs: n` or chat's `logprobs: true` + `top_logprobs: n` -> n alternatives a token (None:
    no log-probabilities)."""
    if top is not None:
        if v is not True:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
        v = _int("top_logprobs", top, lo=0)
    elif isinstance(v, bool):
        v = 0 if v else None
    if v is not None and v > MAX_LOGPROBS:
        raise ParamError("top_logprobs" if top is not None else "logprobs",
                         f"at most {MAX_LOGPROBS} log-probabilities a token can be reported (got {v})")
    return v


def _as_structured(name: str, v) -> dict:
    """response_format / guided_* -> vLLM's structured_outputs form."""
    if name != "response_format":
        return {name[len("guided_"):]: v}
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise ParamError(name, 'response_format must be {"type": "text"}, {"type": "json_object"} or '
                               '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
    if v["type"] == "json_object":
        return {"json_object": True}
    js = v.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise ParamError(name, 'response_format of type json_schema needs "json_schema": {"name": ..., '
                               '"schema": {...}}')
    return {"json": js.get("schema", {})}


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def check_structured(v, name: str = "structured_outputs") -> dict:
    """vLLM's structured_outputs ({"json": schema} | {"regex": r} | {"choice": [..]} | {"grammar": lark or GBNF}
    | {"json_object": true}) -> {"kind", "grammar"}: the grammar as llguidance's JSON, checked here, so a bad
    schema or regex is the request's 400 and never a rank's failure."""
    from llguidance import LLMatcher, gbnf_to_lark

    if not isinstance(v, dict):
        raise ParamError(name, f"{name} must be an object with one of {', '.join(STRUCTURED_KINDS)}")
    given = [k for k in STRUCTURED_KINDS if v.get(k) not in (None, False)]
    other = sorted(set(v) - set(STRUCTURED_KINDS) - {"backend", "disable_any_whitespace"})
    if other:
        raise ParamError(name, f"{name} has fields specdp does not read: {', '.join(other)}")
    if v.get("backend") not in (None, "auto", "guidance", "llguidance"):
        raise ParamError(name, f"{name}.backend: specdp follows grammars with llguidance (got {v['backend']!r})")
    if len(given) != 1:
        raise ParamError(name, f"{name} needs exactly one of {', '.join(STRUCTURED_KINDS)} (got "
                               f"{', '.join(given) or 'none'})")
    kind, spec = given[0], v[given[0]]
    try:
        if kind == "json":
            if isinstance(spec, str):
                spec = json.loads(spec)
            if not isinstance(spec, dict):
                raise ValueError("a JSON schema is an object")
            grammar = LLMatcher.grammar_from_json_schema(spec, overrides=_json_options(v))
        elif kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_json_options(v))
        elif kind == "regex":
            if not isinstance(spec, str):
                raise ValueError("regex must be a string")
            grammar = LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        else:
            if not isinstance(spec, str):
                raise ValueError("grammar must be a string (Lark, or GBNF)")
            grammar = LLMatcher.grammar_from_lark(gbnf_to_lark(spec) if "::=" in spec else spec)
    except Exception as e:  # noqa: BLE001 - whatever llguidance makes of a request's schema is that request's 400
        raise ParamError(name, f"{name}.{kind}: {e}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ParamError(name, f"{name}.{kind} is not a grammar specdp can follow: {error.splitlines()[0][:300]}")
    return {"kind": kind, "grammar": grammar}


def _json_options(v: dict) -> dict:
    """JSON without whitespace between its tokens (", " and ": " separators) unless the request sets
    disable_any_whitespace: false: free whitespace lets a model loop on newlines until max_tokens."""
    if v.get("disable_any_whitespace") is False:
        return {"whitespace_flexible": True}
    return {"whitespace_flexible": False}


def check_token_ids(params: dict, n_vocab: int) -> None:
    """Token ids a request names (logit_bias, stop_token_ids) are in the tokenizer's vocabulary."""
    for key in ("logit_bias", "stop_token_ids"):
        bad = [t for t in params.get(key, ()) if t >= n_vocab]
        if bad:
            raise ParamError(key, f"{key} names token id {bad[0]}, outside the vocabulary [0, {n_vocab})")


def fit_max_tokens(params: dict, prompt_tokens: int, default_max_tokens: int, max_model_len: int,
                   prompt_key: str = "prompt") -> None:
    """The one rule for a request's length, `generate`'s and the server's (DESIGN.md's contract): a prompt of
    max_model_len tokens or more is refused (there is no room for one token); a max_tokens is an upper bound,
    and the sequence also ends at max_model_len (finish_reason "length"), so prompt + max_tokens >
    max_model_len is no error; a request that gives no max_tokens gets the config's default, or the room the
    prompt leaves when that is less. Fills params["max_tokens"]; raises ParamError naming the field."""
    M, P = max_model_len, prompt_tokens
    if P >= M:
        raise ParamError(prompt_key, f"this model's maximum context length is {M} tokens; the prompt has {P} tokens: "
                                     f"shorten the prompt or raise max_model_len")
    if params.get("max_tokens") is None:
        params["max_tokens"] = min(default_max_tokens, M - P)


# --- the request's fields: honoured, accepted only where they ask nothing, or refused ---------------------------

# besides the sampling fields (BOUNDS): where the prompt is, and what else each kind of request may say
REQUEST_FIELDS = {
    "completion": ("prompt", "model", "stream", "stream_options", "user", "n", "echo", "response_format", *GUIDED),
    "chat": ("messages", "model", "stream", "stream_options", "user", "max_completion_tokens", "n", "top_logprobs",
             "response_format", *GUIDED),
    "line": ("id", "prompt", "messages", "max_completion_tokens", "top_logprobs", "response_format", *GUIDED),
}
MAX_N = 16                  # choices one API request may ask for (`n`): each is a request of its own on the ranks
# fields of OpenAI's and vLLM's request bodies that specdp does not act on (yet): accepted at the value that asks
# nothing of the output (or null), so a client that sends defaults still works; any other value is refused
NEUTRAL: dict[str, tuple] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "prompt_logprobs": (0,), "length_penalty": (1,),
    "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (True, False), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "priority": (0,), "use_beam_search": (False,), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "allowed_token_ids": (),
    "bad_words": ([],), "truncate_prompt_tokens": (), "logits_processors": (), "return_tokens_as_token_ids": (False,),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
    "chat_template_kwargs": ({},), "documents": (), "prediction": (), "audio": (), "modalities": (["text"],),
    "reasoning_effort": (), "web_search_options": (), "service_tier": ("auto", "default"), "store": (False,),
    "metadata": (), "verbosity": (), "cache_salt": (), "request_id": (), "min_completion_tokens": (),
}


def _same(v, neutral) -> bool:
    if isinstance(neutral, bool) or isinstance(v, bool):
        return v is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(v, (int, float)) and v == neutral
    return v == neutral


def check_fields(body: dict, kind: str) -> None:
    """Every field of a request is honoured, or refused naming it (ParamError): the sampling fields, the
    fields of `kind` ("completion", "chat" or "line"), a field specdp does not act on only at its neutral value
    (or null), anything else not at all."""
    allowed = REQUEST_FIELDS[kind]
    for name, v in body.items():
        if name in BOUNDS or name in allowed or v is None:
            continue
        if name in NEUTRAL:
            if any(_same(v, n) for n in NEUTRAL[name]):
                continue
            raise ParamError(name, f"{name} is not supported by specdp yet (only {_neutral(name)}); leave it out")
        what = "request" if kind != "line" else "input line"
        raise ParamError(name, f"unknown field '{name}' in the {what}; specdp reads "
                               f"{', '.join(sorted(set(allowed) | set(BOUNDS)))}")


def _neutral(name: str) -> str:
    return " or ".join(["null", *(json.dumps(v) for v in NEUTRAL[name])])
