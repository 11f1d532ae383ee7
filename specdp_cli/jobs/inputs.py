"""Reading a job's input file into requests (in the CLI process, before anything is launched).

`.jsonl` / `.json`: one JSON object a line, `{"prompt": ...}` or `{"messages": [...]}`, with optional
`id`, `max_tokens` (or `max_completion_tokens`) and the other sampling fields of `request_params.py`; any other
key is refused naming it, as the server refuses it (`check_fields`), making the line an error. Anything
else: plain text, one prompt a line. Blank lines are skipped. A line without `id` gets its 1-based
line number. A line that cannot be served becomes an error record (lengths: the server's rule,
`request_params.fit_max_tokens`); duplicate ids refuse the job.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..config import Config
from ..prompts import PromptEncoder, PromptError
from ..request_params import (ParamError, check_fields, check_sampling, check_token_ids, fit_max_tokens,
                              sampling_defaults)
from .fingerprint import input_hash


class InputError(ValueError):
    """The input file cannot be used at all (unreadable, duplicate ids)."""


@dataclass
class JobRequest:
    id: Any
    line: int
    prompt_ids: list[int] = field(default_factory=list)
    params: dict = field(default_factory=dict)   # max_tokens, temperature, top_p, top_k, seed, stop
    error: str | None = None
    fingerprint: dict = field(default_factory=dict)   # {"job", "input"}: what would make its result (fingerprint.py)

    @property
    def key(self) -> str:
        return id_key(self.id)

    @property
    def cost(self) -> int:
        return len(self.prompt_ids) + int(self.params.get("max_tokens", 0))


def id_key(value: Any) -> str:
    """A hashable, type-preserving key for an id (1 and "1" stay different)."""
    return json.dumps(value)


def read_inputs(path: str, cfg: Config, encoder: PromptEncoder) -> list[JobRequest]:
    jsonl = path.lower().endswith((".jsonl", ".json"))
    defaults = sampling_defaults(cfg.sampling, max_tokens=False)     # a line without max_tokens: fit_max_tokens
    M = cfg.max_model_len
    out: list[JobRequest] = []
    seen: dict[str, int] = {}
    try:
        fh = open(path, encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read input file {path}: {e.strerror}") from None
    with fh:
        for n, line in enumerate(fh, start=1):
            text = line.rstrip("\n").rstrip("\r")
            if not text.strip():
                continue
            req = _parse_line(text, n, jsonl, defaults, encoder)
            if req.key in seen:
                raise InputError(f"{path}: duplicate id {req.id!r} on lines {seen[req.key]} and {n}; "
                                 f"ids must be unique (a line without id gets its line number)")
            seen[req.key] = n
            if req.error is None:
                try:                        # the server's rule too (request_params.fit_max_tokens)
                    fit_max_tokens(req.params, len(req.prompt_ids), cfg.sampling.max_tokens, M)
                except ParamError as e:
                    req.error = f"line {n}: {e}"
            req.fingerprint = {"input": input_hash(req.prompt_ids, req.params, raw=text if req.error else None)}
            out.append(req)
    return out


def _parse_line(text: str, n: int, jsonl: bool, defaults: dict, encoder: PromptEncoder) -> JobRequest:
    if not jsonl:
        req = JobRequest(id=n, line=n, params=check_sampling({}, defaults))     # the defaults
        try:
            req.prompt_ids = encoder.encode_text(text)
        except PromptError as e:
            req.error = str(e)
        return req
    try:
        obj = json.loads(text)
    except ValueError as e:
        return JobRequest(id=n, line=n, error=f"line {n} is not valid JSON: {e}")
    except RecursionError:
        return JobRequest(id=n, line=n, error=f"line {n} is nested too deeply")
    if not isinstance(obj, dict):
        return JobRequest(id=n, line=n, error=f"line {n} must be a JSON object with \"prompt\" or \"messages\"")
    rid = obj.get("id", n)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        return JobRequest(id=n, line=n, error=f"line {n}: id must be a string or an integer (got {rid!r})")
    req = JobRequest(id=rid, line=n)
    try:
        check_fields(obj, "line")                           # the server's rules too
        req.params = check_sampling(obj, defaults)
        check_token_ids(req.params, len(encoder.tokenizer))
        if "prompt" in obj:
            req.prompt_ids = encoder.encode_text(obj["prompt"])
        elif "messages" in obj:
            req.prompt_ids = encoder.encode_chat(obj["messages"])
        else:
            raise ValueError("needs \"prompt\" (a string) or \"messages\" (a list of chat messages)")
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
    except (ValueError, PromptError) as e:
        req.error = f"line {n}: {e}"
    return req
