"""OpenAI request bodies -> internal requests, with the errors OpenAI clients expect.

Bodies are parsed by hand (not by a pydantic model) so every mistake becomes a 4xx with an
OpenAI-style body `{"error": {"message", "type", "param", "code"}}` and never a 422 or a 500.
Every field is honoured or refused naming it (`request_params.check_fields`): nothing is ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from ..prompts import PromptEncoder, PromptError
from ..request_params import (INT64_MAX, MAX_N, ParamError, check_fields, check_sampling, check_token_ids,
                              fit_max_tokens, sampling_defaults)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: dict                   # the sampling fields, checked (request_params.check_sampling), max_tokens filled
    stream: bool
    include_usage: bool
    chat: bool
    echo_model: str
    n: int = 1                     # choices: each one a request of its own (choice i: seed + i when seeded)
    echo: str = ""                 # completions' echo: the prompt's text, put before each choice's text
    extra: dict = field(default_factory=dict)

    def choice(self, i: int) -> "GenRequest":
        """The request of choice i: its own seed (seed + i, wrapping within 64 bits) when the request gives one."""
        seed = self.params["seed"]
        if i == 0 or seed is None:
            return self
        s = seed + i
        if s > INT64_MAX:
            s -= 2 ** 64
        return replace(self, params={**self.params, "seed": s})

    @property
    def max_tokens(self) -> int:
        return self.params["max_tokens"]

    @property
    def stop(self) -> list[str]:
        return self.params["stop"]


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def parse_request(body: dict, chat: bool, encoder: PromptEncoder, model_name: str, max_model_len: int,
                  defaults) -> GenRequest:
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'",
                       param="model", code="model_not_found")
    try:
        check_fields(body, "chat" if chat else "completion")
    except ParamError as e:
        raise bad(str(e), e.param) from None
    try:
        if chat:
            if "messages" not in body:
                raise bad("'messages' is required", "messages")
            msgs = body["messages"]
            if isinstance(msgs, list):
                msgs = [_flatten_content(m) for m in msgs]
            prompt_ids = encoder.encode_chat(msgs)
        else:
            if "prompt" not in body:
                raise bad("'prompt' is required", "prompt")
            prompt = body["prompt"]
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]          # a batch of one
            if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                raise bad("a list of several prompts is not supported; send one prompt per request", "prompt")
            prompt_ids = encoder.encode_text(prompt)
            if not prompt_ids:
                raise bad("the prompt is empty", "prompt")
    except PromptError as e:
        raise bad(str(e), "messages" if chat else "prompt") from None
    try:
        p = check_sampling(body, sampling_defaults(defaults, max_tokens=False))
        check_token_ids(p, len(encoder.tokenizer))
        fit_max_tokens(p, len(prompt_ids), defaults.max_tokens, max_model_len, "messages" if chat else "prompt")
    except ParamError as e:
        raise bad(str(e), e.param) from None
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    n = body.get("n")
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise bad(f"n must be an integer in [1, {MAX_N}] (got {n!r})", "n")
    if n > 1 and stream:
        raise bad("n > 1 is not supported with stream yet; ask without stream (or send n requests)", "n")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad("'echo' must be a boolean", "echo")
    echo_text = ""
    if echo and not chat:          # the prompt as sent (a prompt of token ids: their text)
        echo_text = prompt if isinstance(prompt, str) else encoder.tokenizer.decode(
            prompt_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return GenRequest(prompt_ids=prompt_ids, params=p, stream=stream,
                      include_usage=bool((opts or {}).get("include_usage")), chat=chat, echo_model=model_name, n=n,
                      echo=echo_text)


def _flatten_content(m):
    """OpenAI allows content as a list of parts; text parts are joined."""
    if isinstance(m, dict) and isinstance(m.get("content"), list):
        parts = m["content"]
        if all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
            return {**m, "content": "".join(str(p.get("text", "")) for p in parts)}
        raise bad("only text content parts are supported", "messages")
    return m
