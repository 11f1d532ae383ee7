"""Prompts to token ids: plain text, or chat messages through a chat template."""
from __future__ import annotations

import os


class PromptError(ValueError):
    """A prompt that cannot be served; the message says what to change."""


class PromptEncoder:
    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.template = self._resolve(chat_template)

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
        return list(self.tokenizer(_unicode(text, "prompt"))["input_ids"])

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
        return list(self.tokenizer(_unicode(text, "chat messages"), add_special_tokens=False)["input_ids"])


def _unicode(text: str, what: str) -> str:
    """Text a tokenizer can take: JSON can carry lone surrogates ("\\ud800"), which are no Unicode
    characters and which tokenizers reject with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"the {what} contain{'s' if what == 'prompt' else ''} a lone surrogate "
                          f"({text[e.start]!r} at character {e.start}), which is not valid Unicode") from None
    return text
