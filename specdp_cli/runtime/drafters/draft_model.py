"""A small Hugging Face model as drafter, with its own slot KV cache.

Forward 1 catches the drafter's cache up with each drafting sequence (the tokens verified last
step, or a whole prompt) and carries this step's prompt chunks; forwards 2..n feed each row its
previous draft. Rows stop taking part after their own k_eff drafts; a forward with no rows at
all is a padding batch, so the number of forwards is always what the engine asked for.
"""
from __future__ import annotations

import torch

from ..model_runner import ModelRunner, Segment
from ..sampling import STREAM_DRAFT, draw, row_tensors, select_rows
from ..scheduler import Sequence
from .base import Drafter, Drafts


class ModelDrafter(Drafter):
    has_forward = True

    def __init__(self, runner: ModelRunner, D: int, k: int):
        self.runner = runner
        self.D, self.k = D, k

    def will_draft(self, seq: Sequence) -> bool:
        """Whether the sequence can ever draft: after its prompt, L = P + 1 must fit the drafter."""
        return seq.num_prompt + 1 + self.k <= self.D and seq.req.params.max_tokens >= 2

    def propose(self, rows, prefill, n_forwards, step) -> Drafts:
        dev = self.runner.device
        params = [seq.req.params for seq, _ in rows]
        rt = row_tensors(params, dev)
        tokens: list[list[int]] = [[] for _ in rows]
        probs_by_fwd: list[tuple[int, list[int], torch.Tensor]] = []
        K = max((ke for _, ke in rows), default=0)
        for j in range(n_forwards):
            active = [i for i, (_, ke) in enumerate(rows) if ke > j]
            if j == 0:
                segs = [Segment(seq.slot, seq.draft_len, seq.tokens[seq.draft_len:], keep=1) for seq, _ in rows]
                segs += [Segment(seq.slot, seq.draft_len, seq.tokens[seq.draft_len:end])
                         for seq, _start, end in prefill if self.will_draft(seq) and seq.draft_len < end]
            else:
                segs = [Segment(rows[i][0].slot, rows[i][0].L + j - 1, [tokens[i][-1]], keep=1) for i in active]
            logits = self.runner.forward(segs, step, f"drafter forward {j + 1}/{n_forwards}")
            if not active:
                continue
            sub = rt if len(active) == len(rows) else select_rows(rt, active, [params[i] for i in active])
            pos = None if sub["all_greedy"] else \
                torch.tensor([rows[i][0].L + j for i in active], dtype=torch.long).to(dev)
            tok, probs = draw(logits, sub, pos, STREAM_DRAFT)
            for i, t in zip(active, tok.tolist()):
                tokens[i].append(t)
            if probs is not None:
                probs_by_fwd.append((j, active, probs))
        for seq, ke in rows:
            if n_forwards:
                seq.draft_len = seq.L + min(ke, n_forwards) - 1
        if n_forwards:
            for seq, _start, end in prefill:
                if self.will_draft(seq):
                    seq.draft_len = max(seq.draft_len, end)
        return Drafts(tokens, self._stack(probs_by_fwd, len(rows), K))

    def _stack(self, probs_by_fwd, R: int, K: int) -> torch.Tensor | None:
        if not probs_by_fwd:
            return None
        V = probs_by_fwd[0][2].shape[-1]
        out = torch.zeros(R, K, V, device=probs_by_fwd[0][2].device)
        for j, active, p in probs_by_fwd:
            out[torch.tensor(active).to(out.device), j] = p
        return out

    def on_accept(self, seq: Sequence, old_len: int, accepted: int) -> None:
        # valid drafter positions: the old tokens plus the accepted drafts it was fed
        seq.draft_len = min(seq.draft_len, old_len + accepted)

    def on_move(self, seq: Sequence, from_slot: int) -> None:
        self.runner.cache.move(from_slot, seq.slot, seq.draft_len)
