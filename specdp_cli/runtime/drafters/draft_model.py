"""A small Hugging Face model as drafter, with its own KV cache over the shared block tables.

Forward 1 catches the drafter's cache up with each drafting row — the one or two tokens verified
last step (the bonus token, and the last draft when all were accepted) — and, in a step with prompt
chunks, prefills those alongside (then it is a mixed forward). Forwards 2..n feed each row its
previous draft, on the device: the drafts, positions and row masks never leave the GPU, so the
n forwards run back to back (each a CUDA graph replay) with no host sync. A row stops taking part
after its own drafts; a forward with no real row is a padding batch, so the number of forwards is
always what the engine asked for.
"""
from __future__ import annotations

import torch

from ..model_runner import MixedBatch, MixedRow, ModelRunner
from ..sampling import STREAM_DRAFT, draw
from ..scheduler import Sequence
from ..step_inputs import CATCH, DSTART, LEN, NCATCH, NDRAFT
from .base import Drafter, Drafts


class ModelDrafter(Drafter):
    has_forward = True

    def __init__(self, runner: ModelRunner, D: int, k: int):
        self.runner = runner
        self.D, self.k = D, k

    def will_draft(self, seq: Sequence) -> bool:
        """Whether the sequence drafts at all: at its first decode step (L = prefill + 1) it must fit
        the drafter (L + k <= D) and have two tokens left (k_eff >= 1)."""
        L = seq.prefill_len + 1
        return L + self.k <= self.D and seq.req.params.max_tokens - (L - seq.num_prompt) >= 2

    def host_drafts(self, rows, n_forwards) -> Drafts:
        return Drafts([min(ke, n_forwards) for _, ke in rows])

    def _prefill_rows(self, prefill, n_forwards) -> list[tuple[Sequence, int, int]]:
        if not n_forwards:
            return []
        return [(s, s.draft_len, end) for s, _start, end in prefill if self.will_draft(s) and s.draft_len < end]

    def mixed_fields(self, rows, prefill, drafts, n_forwards) -> tuple[int, int]:
        catch = [s.L - s.draft_len for (s, _), n in zip(rows, drafts.n) if n]
        chunks = self._prefill_rows(prefill, n_forwards)
        mixed = bool(chunks) or max(catch, default=0) > 2
        return int(mixed), sum(catch) + sum(end - start for _, start, end in chunks)

    def propose(self, ctx, drafts: Drafts) -> None:
        K = ctx.sizes.K
        if not K:
            return
        r, inp, R = self.runner, ctx.inputs, ctx.sizes.R_pad
        L, n = inp.col(LEN, R), inp.col(NDRAFT, R)
        ctx.publish(f"drafter forward 1/{K}")
        if ctx.sizes.draft_mixed:
            logits = self._first_mixed(ctx, drafts)
        else:
            r.ids[:R * 2].view(R, 2).copy_(inp.dev[:R, CATCH:CATCH + 2])
            r.start[:R].copy_(inp.col(DSTART, R))
            r.n_real[:R].copy_(inp.col(NCATCH, R))
            logits = r.uniform(R, 2)
        tokens = torch.zeros((R, ctx.sizes.T - 1), dtype=torch.long, device=r.device)
        probs = []
        for j in range(1, K + 1):
            if j > 1:
                ctx.publish(f"drafter forward {j}/{K}")
                r.ids[:R].copy_(d)
                torch.add(L, j - 2, out=r.start[:R])
                r.n_real[:R].copy_(n >= j)
                logits = r.uniform(R, 1)
            d, p = draw(logits, ctx.rt, L + (j - 1), STREAM_DRAFT)
            tokens[:, j - 1] = d
            if p is not None:
                probs.append(p)
        ctx.padding.append(not any(drafts.n) and not self._prefill_rows(ctx.prefill, K))
        for (s, _), m in zip(ctx.rows, drafts.n):
            if m:
                s.draft_len = s.L + m - 1
        for s, _start, end in self._prefill_rows(ctx.prefill, K):
            s.draft_len = end
        drafts.tokens = tokens
        if probs:
            q = torch.zeros((R, ctx.sizes.T - 1, probs[0].shape[-1]), device=r.device)
            q[:, :len(probs)] = torch.stack(probs, 1)
            drafts.probs = q

    def _first_mixed(self, ctx, drafts: Drafts) -> torch.Tensor:
        """Forward 1 as a mixed batch (prompt chunks, or a long catch-up); logits [R_pad, V]."""
        batch = MixedBatch(n_pad=ctx.sizes.draft_mixed)
        idx = []
        for i, ((s, _), m) in enumerate(zip(ctx.rows, drafts.n)):
            if m:
                catch = s.tokens[s.draft_len:]
                batch.rows.append(MixedRow(s.blocks, s.draft_len, catch, len(catch), "last"))
                idx.append(i)
        for s, start, end in self._prefill_rows(ctx.prefill, ctx.sizes.K):
            batch.rows.append(MixedRow(s.blocks, start, s.tokens[start:end], end - start))
        kept = self.runner.mixed(batch)
        logits = torch.zeros((ctx.sizes.R_pad, kept.shape[-1]), device=kept.device)
        if idx:
            logits[torch.tensor(idx, device=kept.device)] = kept
        return logits

    def on_accept(self, seq: Sequence, old_len: int, accepted: int) -> None:
        # valid drafter positions: the old tokens plus the accepted drafts it was fed
        seq.draft_len = min(seq.draft_len, old_len + accepted)
