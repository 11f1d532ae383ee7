"""The request bodies of the OpenAI endpoints as JSON schemas, for /openapi.json (so clients and
schema-driven fuzzers know what to send). Bodies are still parsed by `protocol.py`, which is what
decides: the schema lists exactly the fields it reads, with the bounds of `request_params.py`, and the fields it
accepts only at one value; any other field is refused."""
from __future__ import annotations

from ..request_params import BOUNDS, GUIDED, MAX_LOGPROBS, MAX_N, NEUTRAL

# the sampling fields with their bounds as request_params.py defines them (each may be null: the default); then
# the fields of OpenAI's and vLLM's bodies specdp does not act on yet, with the one value each accepts (or null)
SAMPLING = {
    "model": {"type": "string", "description": "the served model's name (optional)"},
    **{name: {**bounds, "nullable": True} for name, bounds in BOUNDS.items()},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                       "additionalProperties": False, "nullable": True},
    "user": {"type": "string", "nullable": True, "description": "an identifier of the end user; it changes nothing"},
    **{name: {"enum": list(vals), "nullable": True, "description": "not supported yet: only this value (or null)"}
       for name, vals in NEUTRAL.items()},
    "echo": {"type": "boolean", "nullable": True, "description": "completions: the prompt's text before each choice's"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N, "nullable": True,
          "description": "choices (each a request of its own; choice i samples with seed + i); not with stream"},
    "response_format": {"type": "object", "nullable": True, "required": ["type"],
                        "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                                       "json_schema": {"type": "object"}},
                        "description": "json_object / json_schema: the output follows it (llguidance), with speculation"},
    **{name: {"nullable": True, "description": f"vLLM's older name of structured_outputs.{name[7:]}"}
       for name in GUIDED},
}

COMPLETION = {
    "type": "object",
    "additionalProperties": False,
    "required": ["prompt"],
    "properties": {
        "prompt": {"anyOf": [{"type": "string"},
                             {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                             {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}]},
        **SAMPLING,
    },
}

MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant"]},
        "content": {"anyOf": [{"type": "string"},
                              {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                                          "properties": {"type": {"type": "string", "enum": ["text"]},
                                                                         "text": {"type": "string"}}}}]},
    },
}

CHAT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        "max_completion_tokens": {**BOUNDS["max_tokens"], "nullable": True},
        **SAMPLING,
        "logprobs": {"type": "boolean", "nullable": True, "description": "the tokens' log-probabilities"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS, "nullable": True,
                         "description": "alternatives a token (needs logprobs: true)"},
        "echo": {"enum": [False], "nullable": True, "description": "not supported yet: only this value (or null)"},
    },
}


def request_body(kind: str) -> dict:
    """FastAPI's `openapi_extra` for a route whose body is `kind` ("completion" or "chat")."""
    schema = COMPLETION if kind == "completion" else CHAT
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
