"""A small Hugging Face model as drafter, with its own KV cache over the shared block tables.

Forward 1 catches the drafter's cache up with each drafting row — the one or two tokens verified
last step (the bonus token, and the last draft when all were accepted), or every token since the
row last drafted when steps with k = 0 let the drafter sit out (up to a prompt chunk's width per
step: a row further behind feeds that much and drafts again once caught up) — and takes the step's
prompt chunks beside the target. Forwards 2..n feed each row its previous draft, on the device:
the drafts, positions and row masks never leave the GPU, so the n forwards run back to back (CUDA
graph replays) with no host sync. A row stops taking part after its own drafts; a forward with no
real row is a padding batch, so the number of forwards is always what the engine asked for.
"""
from __future__ import annotations

import torch

from ..model_runner import ModelRunner
from ..sampling import STREAM_DRAFT, draw
from ..scheduler import Sequence
from ..step_inputs import DNREAL, DOUT, DSTART, LEN, NDRAFT
from .base import Drafter, Drafts


class ModelDrafter(Drafter):
    has_forward = True
    catches_up = True

    def __init__(self, runner: ModelRunner, D: int, k: int):
        self.runner = runner
        self.D, self.k = D, k
        self._js = torch.arange(2, k + 1, device=runner.device)

    def prefills(self, seq: Sequence) -> bool:
        """Whether the sequence drafts at all: at its first decode step (L = prefill + 1) it must fit
        the drafter (L + k <= D) and have two tokens left (k_eff >= 1)."""
        L = seq.prefill_len + 1
        return (L + self.k <= self.D and seq.req.params.max_tokens - (L - seq.num_prompt) >= 2
                and seq.req.params.speculative)

    def host_drafts(self, rows, n_forwards) -> Drafts:
        return Drafts([min(ke, n_forwards) for _, ke in rows])

    def kv_upto(self, seq: Sequence) -> float:
        return seq.draft_len

    def catch_up(self, seq: Sequence, n: int, width: int) -> tuple[int, list[int], int]:
        if seq.pending:      # async scheduling: the one or two tokens are on the device (`async_rows.feed`)
            return seq.draft_len, [0, 0], n
        missed = seq.tokens[seq.draft_len:]
        if len(missed) > width:
            return seq.draft_len, missed[:width], 0
        return seq.draft_len, missed, n

    def propose(self, ctx):
        sz, inp, r = ctx.sizes, ctx.inputs, self.runner
        R, K = sz.R_pad, sz.K
        ctx.publish(f"drafter forward 1/{max(K, 1)}")
        r.set_rows(R, inp.drafter_ids(R, sz.T1), inp.col(DSTART, R), inp.col(DNREAL, R), inp.col(DOUT, R))
        logits = r.forward(R, sz.T1, ctx.graphs)[:, 0]
        if not K:
            return None, None
        L, n = inp.col(LEN, R), inp.col(NDRAFT, R)
        tokens = torch.zeros((R, sz.T_dec - 1), dtype=torch.long, device=r.device)
        probs = []

        grammar = ctx.adjust is not None and ctx.adjust.grammar    # structured output: drafts follow the grammar

        def take(j: int, logits: torch.Tensor) -> torch.Tensor:
            """Draw draft j (at position L + j - 1) of every row."""
            if grammar:
                logits = ctx.adjust.mask_draft(logits, tokens, j)
            d, p = draw(logits, ctx.rt, None if ctx.rt["all_greedy"] else L + (j - 1), STREAM_DRAFT)
            tokens[:, j - 1] = d
            if p is not None:
                probs.append(p)
            return d

        d = take(1, logits)
        if K > 1:
            # forwards 2..K feed draft j - 1 at position L + j - 2, in rows that draft at least j: the
            # rows' starts advance by one in place, and which rows take part is one mask for all forwards
            r.set_rows(R, start=L - 1)
            taking = self._js[:K - 1].view(-1, 1) <= n.view(1, R)           # [K - 1, R]: forward j's rows
        for j in range(2, K + 1):
            ctx.publish(f"drafter forward {j}/{K}")
            r.start[:R].add_(1)
            r.set_rows(R, d.view(R, 1), n_real=taking[j - 2])
            d = take(j, r.forward(R, 1, ctx.graphs)[:, 0])
        if grammar:
            ctx.adjust.end_drafting()
        if not probs:
            return tokens, None
        q = torch.zeros((R, sz.T_dec - 1, probs[0].shape[-1]), device=r.device)
        q[:, :len(probs)] = torch.stack(probs, 1)
        return tokens, q

    def feeds_on_device(self, seq: Sequence) -> bool:
        """The next row drafts nothing, or all the draft model has not seen are the one or two tokens of the step on
        the device (it drafted in that step, or took the prompt that step ended)."""
        return seq.catch_up_on_device or seq.k_eff(self.k, self.D) == 0

    def after_step(self, ctx) -> None:
        for row in ctx.rows:
            s = row.seq
            s.catch_up_on_device = bool(row.n_drafts) or (row.done and bool(row.d_tokens))
            if not row.n_drafts and row.d_tokens:      # a piece of a prompt chunk, or a catch-up without drafts
                s.draft_len = max(s.draft_len, row.d_start + len(row.d_tokens))

    def on_accept(self, seq: Sequence, old_len: int, accepted: int, n_drafts: int) -> None:
        # valid drafter positions: the old tokens plus the accepted drafts it was fed (all but the last draft)
        seq.draft_len = old_len + min(accepted, n_drafts - 1)
