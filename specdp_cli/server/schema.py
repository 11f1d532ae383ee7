"""The request bodies of the OpenAI endpoints as JSON schemas, for /openapi.json (so clients and
schema-driven fuzzers know what to send). Bodies are still parsed by `protocol.py`, which is what
decides: the schema describes the fields it reads, with the bounds of `request_params.py`."""
from __future__ import annotations

INT64 = {"type": "integer", "minimum": -(2 ** 63), "maximum": 2 ** 63 - 1}

SAMPLING = {
    "model": {"type": "string", "description": "the served model's name (optional)"},
    "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "nullable": True, "description": "0: greedy"},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "nullable": True},
    "top_k": {"type": "integer", "minimum": -1, "nullable": True, "description": "-1 or 0: off"},
    "seed": {**INT64, "nullable": True},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}], "nullable": True},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}, "nullable": True},
    "n": {"type": "integer", "enum": [1], "nullable": True},
    "speculative": {"type": "boolean", "nullable": True,
                    "description": "specdp extension: false = this request verifies no drafts (others still speculate)"},
}

COMPLETION = {
    "type": "object",
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
    "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
        **SAMPLING,
    },
}


def request_body(kind: str) -> dict:
    """FastAPI's `openapi_extra` for a route whose body is `kind` ("completion" or "chat")."""
    schema = COMPLETION if kind == "completion" else CHAT
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
