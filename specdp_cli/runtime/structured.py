"""Structured output through llguidance: a request's grammar (`request_params.check_structured` made it from a
JSON schema, a regex, a list of choices or a Lark / GBNF grammar) follows its sequence's tokens.

Speculation: at a verification the grammar gives the token mask of the row's first position and of each position
after its drafts — llguidance advances through the drafts and rolls back — so the mask of position j is the
grammar's state after drafts 0..j-1 (`logits_process.py` applies it). A draft model drafts under the grammar too
(`draft_masks`): each draft consumed while the next is drafted, all rolled back after. Only the tokens a step
emits are consumed for good (`Grammar.accept`): the state rolls back with rejected drafts by construction.
Masks are computed for all rows at once on llguidance's thread pool, into int32 bitmasks (bit t % 32 of word
t // 32 allows token t).
"""
from __future__ import annotations

import torch


class GrammarCompiler:
    """One per engine: the tokenizer as llguidance sees it and its thread pool (built at the first request with a
    grammar)."""

    def __init__(self, tokenizer, n_vocab: int, eos: set[int]):
        self.tokenizer, self.n_vocab, self.eos = tokenizer, n_vocab, sorted(eos)
        self._ll = self._executor = None

    def grammar(self, spec: dict) -> "Grammar":
        import llguidance
        import llguidance.hf

        if self._ll is None:
            eos = self.eos[0] if len(self.eos) == 1 else (self.eos or None)
            self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.n_vocab, eos_token=eos)
            self._executor = llguidance.LLExecutor()
        return Grammar(llguidance.LLMatcher(self._ll, spec["grammar"], log_level=0), self._executor, self.eos)


class Grammar:
    def __init__(self, matcher, executor, eos: list[int]):
        self.m, self.executor, self.eos = matcher, executor, eos
        self._drafted = 0              # drafts consumed while a draft model drafts (rolled back after)
        self._off_grammar = False      # a draft the grammar refused: this row's later drafts go unmasked

    def accept(self, tokens: list[int]) -> bool:
        """Consume the emitted tokens (an eos that ends the sequence is not among them). False: the grammar
        refused one, or could not be followed from the start (llguidance's error state)."""
        return (not tokens or self.m.consume_tokens(tokens)) and not self.m.is_error()

    @property
    def error(self) -> str:
        return self.m.get_error() or "a token the grammar refuses"

    def end_drafting(self) -> None:
        if self._drafted:
            self.m.rollback(self._drafted)
        self._drafted, self._off_grammar = 0, False


def verify_masks(rows: list[tuple[Grammar, int, list[int]]], bits: torch.Tensor) -> None:
    """rows: (grammar, index, drafts): bits[index + j] = the mask after drafts[:j], j = 0..len(drafts), up to the
    first draft the grammar refuses (rows after it keep what they hold: they are never emitted)."""
    if rows:
        ex, size = rows[0][0].executor, (bits.data_ptr(), bits.shape[1] * 4, bits.shape[0])
        drafting = [(g.m, i, d) for g, i, d in rows if d]            # (llguidance takes no empty draft list here)
        if drafting:
            ex.unsafe_compute_mask_ptr_with_draft_token(drafting, *size)
        if len(drafting) < len(rows):
            ex.unsafe_compute_mask_ptr([(g.m, i) for g, i, d in rows if not d], *size)
        _eos_where_empty(bits, [i + j for g, i, d in rows for j in range(len(d) + 1)], rows[0][0].eos)


def draft_masks(rows: list[tuple[Grammar, int, int | None]], bits: torch.Tensor) -> None:
    """While a draft model drafts: each row's grammar consumes its previous draft (None before the first), then
    bits[index] = the mask of its next draft (left as it is once a draft fell outside the grammar)."""
    live = []
    for g, i, prev in rows:
        if prev is not None and not g._off_grammar:
            if g.m.is_stopped() or g.m.try_consume_tokens([prev]) != 1:
                g._off_grammar = True
            else:
                g._drafted += 1
        if not g._off_grammar:
            live.append((g, i))
    if live:
        live[0][0].executor.unsafe_compute_mask_ptr([(g.m, i) for g, i in live], bits.data_ptr(), bits.shape[1] * 4,
                                                    bits.shape[0])
        _eos_where_empty(bits, [i for _, i in live], live[0][0].eos)


def _eos_where_empty(bits: torch.Tensor, index: list[int], eos: list[int]) -> None:
    """A mask that allows nothing (llguidance's error state) allows eos instead: the sequence ends, its
    grammar's error reported (`Grammar.accept`), rather than sampling from nothing."""
    idx = torch.tensor(index, dtype=torch.long)
    empty = idx[~bits[idx].any(1)]
    for t in eos:
        bits[empty, t // 32] |= (1 << (t % 32)) - ((1 << 32) if t % 32 == 31 else 0)      # bit 31: int32's sign
