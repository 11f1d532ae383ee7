"""Prompts to token ids: plain text, or chat messages through a chat template."""
from __future__ import annotations

import os


class PromptError(ValueError):
    """A prompt that cannot be served; the message says what to change."""


class PromptEncoder:
    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.template = self._resolve(chat_template)
        self.backend = _direct_backend(tokenizer)

    def _resolve(self, chat_template: str | None) -> str | None:
        if chat_template:
            if "{{" in chat_template or "{%" in chat_template:
                return chat_template
            with open(os.path.expanduser(chat_template), encoding="utf-8") as fh:
                return fh.read()
        return getattr(self.tokenizer, "chat_template", None) or None

    def encode_text(self, text) -> list[int]:
        """A prompt: a string, or already a list of token ids (as the OpenAI completions API allows)."""
        if isinstance(text, list):
            n = len(self.tokenizer)
            # exactly int (JSON's true/false are bools), in range; C-level passes: 2x faster than a generator
            # over a 1,500-id prompt, each request's cost on the frontend's one event loop
            if not text or set(map(type, text)) != {int} or min(text) < 0 or max(text) >= n:
                raise PromptError(f"a token-id prompt must be a non-empty list of integers in [0, {n})")
            return list(text)
        if not isinstance(text, str):
            raise PromptError("prompt must be a string or a list of token ids")
        return self._encode(_unicode(text, "prompt"), True)

    def _encode(self, text: str, special: bool) -> list[int]:
        if self.backend is not None:
            return self.backend.encode_batch([text], add_special_tokens=special)[0].ids
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def encode_chat(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise PromptError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
        if not self.template:
            raise PromptError("this model's tokenizer has no chat template: set chat_template in the config "
                              "(a Jinja template, or a path to one), or send a plain prompt")
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template error is about the user's template or messages
            raise PromptError(f"the chat template failed on these messages: {e}") from None
        return self._encode(_unicode(text, "chat messages"), False)


# Strings whose tokens the direct call must give as the tokenizer's own call does before it is used
_PROBES = ("", "Hello, world!", "  two leading spaces", "line\nbreak\n\n\ttab", "héllo wörld 世界 🙂",
           "def f(x):\n    return x ** 2  # code\n", "12345 67.89e-3")


def _direct_backend(tokenizer):
    """The Rust tokenizer (`tokenizers.Tokenizer`) behind a transformers tokenizer whose call passes the text to it
    as it is, else None. Through it a prompt's ids come without transformers' per-call Python (a short prompt in 25
    µs instead of 41, benchmarks/prompt_encode.py), by `encode_batch`, which releases the GIL while it works
    (`encode` does not): a long prompt tokenized on the API server's encoding thread leaves the event loop running.
    Used only where the call is transformers 5's TokenizersBackend one, unchanged by the tokenizer's class, the Rust
    tokenizer truncates and pads nothing, splits special tokens as the call would, and gives the same ids on _PROBES
    (with and without special tokens)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or backend is None or not hasattr(backend, "encode_batch")
            or cls._encode_plus is not TokenizersBackend._encode_plus
            or cls.__call__ is not PreTrainedTokenizerBase.__call__
            or backend.truncation is not None or backend.padding is not None
            or backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False))):
        return None
    probes = _PROBES + ("".join(getattr(tokenizer, "all_special_tokens", ())),)
    for text in probes:
        for special in (True, False):
            if backend.encode_batch([text], add_special_tokens=special)[0].ids != list(
                    tokenizer(text, add_special_tokens=special)["input_ids"]):
                return None
    return backend


def _unicode(text: str, what: str) -> str:
    """Text a tokenizer can take: JSON can carry lone surrogates ("\\ud800"), which are no Unicode
    characters and which tokenizers reject with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"the {what} contain{'s' if what == 'prompt' else ''} a lone surrogate "
                          f"({text[e.start]!r} at character {e.start}), which is not valid Unicode") from None
    return text
