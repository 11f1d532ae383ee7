"""EAGLE drafting (EAGLE-1 and EAGLE-3 heads), proposed after verification (vLLM's order: verify -> accept -> propose).

The head needs the target's hidden states, which exist only once the target has run; so in a
step the head works after the target's forward and the rejection sampler, on the device, over
the very rows of the target's forward:

  forward 1 (R x T, the target's shape; it runs in every step, k = 0 included, because the target's
    features of the verified positions exist only in that step — so the head never falls behind): at
    each row position j the head takes (token j+1, the
    target's feature at j: its last hidden state for EAGLE-1, `fc` over three layers' for EAGLE-3)
    — the row's tokens shifted by one, with the token that follows the
    row put in at its place: for a decode row the token the step drew after its accepted drafts
    (column n_out - 1), for a prompt row the next prompt token, or the token the step drew after a
    prompt's end. So its KV cache learns every position the target verified, and the output at
    that column is the first draft of the next step.
  forwards 2..k (R x 1): feed the previous draft and the head's predicted feature.

The k drafts (greedy: the head's argmax; verification then treats them as deterministic, which
keeps sampling lossless) travel to the host with the step's results and are the next step's
drafts. Rows that draft nothing (prompt rows before a prompt's end, padding) take no part in
forwards 2..k. The head writes its KV cache through the target's block tables, up to k - 1
positions past the verified ones (the scheduler reserves them: `lookahead`).
"""
from __future__ import annotations

import torch

from .. import ops
from ..model_runner import ModelRunner
from ..step_inputs import NEXT, NREAL, START
from .base import Drafter, Drafts


class EagleDrafter(Drafter):
    has_forward = True
    after_verify = True

    def __init__(self, runner: ModelRunner, target: ModelRunner, k: int):
        self.runner, self.target, self.k = runner, target, k
        self.head = runner.model
        self.head.attach(target)
        self._zeros = torch.zeros_like(runner.out_start)
        # forwards 2..k: each row's first position and whether it drafts (decode rows, rows ending a prompt)
        self._next_start = torch.zeros_like(runner.out_start)
        self._drafting = torch.zeros_like(runner.out_start)

    def _head_inputs(self, inp, R: int, T: int, tokens: torch.Tensor, n_out: torch.Tensor) -> None:
        """Forward 1's rows, straight into the runner's inputs: the target's tokens shifted by one, with the token
        that follows the row at its column (a decode row: the token drawn after its accepted drafts, column
        n_out - 1; a prompt row: the next prompt token, or the one drawn after the prompt's end); also forwards
        2..k's first positions and drafting rows. One kernel on CUDA (`triton_kernels.head_inputs`)."""
        r, ids = self.runner, self.target.ids[:R * T].view(R, T)
        start, n_real, nxt = inp.col(START, R), inp.col(NREAL, R), inp.col(NEXT, R)
        if ids.is_cuda:
            from .. import triton_kernels
            triton_kernels.head_inputs(ids, tokens, n_out, start, n_real, nxt, r.ids, r.start, r.n_real, r.out_start,
                                       self._next_start, self._drafting)
            return
        shifted, col, self._next_start[:R], self._drafting[:R] = head_inputs(ids, tokens, n_out, start, n_real, nxt)
        r.set_rows(R, shifted, start, n_real, col)

    def host_drafts(self, rows, n_forwards) -> Drafts:
        n = [min(ke, len(s.next_drafts)) for s, ke in rows]
        return Drafts(n, [s.next_drafts[:m] for (s, _), m in zip(rows, n)])

    def propose_after(self, ctx, tokens: torch.Tensor, n_out: torch.Tensor) -> torch.Tensor:
        """tokens [R, W], n_out [R]: what verification emitted. Returns the next step's drafts [R, K]."""
        sz, r = ctx.sizes, self.runner
        R, T, K = sz.R_pad, sz.T, sz.K
        ctx.publish(f"drafter forward 1/{max(K, 1)}")
        self.head.prepare_features(R * T)
        self._head_inputs(ctx.inputs, R, T, tokens, n_out)
        d = ops.argmax(r.forward(R, T, ctx.graphs)[:, 0])
        drafts = torch.zeros((R, K), dtype=torch.long, device=r.device)
        if not K:           # a step with k = 0: the head still learns the verified positions, drafts nothing
            return drafts
        if K > 1:     # forwards 2..K: the rows' positions advance by one in place (from start + col + 1)
            r.set_rows(R, start=self._next_start[:R], n_real=self._drafting[:R], out_start=self._zeros[:R])
        for j in range(2, K + 1):
            ctx.publish(f"drafter forward {j}/{K}")
            self._advance(R, d, drafts, j - 2)
            d = ops.argmax(r.forward(R, 1, ctx.graphs)[:, 0])
        drafts[:, K - 1] = d
        return drafts

    def _advance(self, R: int, d: torch.Tensor, drafts: torch.Tensor, j: int) -> None:
        """Before forward j + 2: draft j (d [R]) goes into drafts[:, j] and becomes each row's next token, one
        position on, with the head's predicted feature as its input's. One kernel on CUDA."""
        r, feats = self.runner, self.head.feats
        if d.is_cuda:
            from ..triton_kernels import next_draft
            next_draft(d, drafts, j, r.start, r.ids, feats, r.hidden, R)
            return
        drafts[:, j] = d
        feats[:R].copy_(r.hidden[:R])
        r.start[:R].add_(1)
        r.set_rows(R, d.view(R, 1))


def head_inputs(ids, tokens, n_out, start, n_real, nxt) -> tuple:
    """Forward 1's rows (the torch expressions `triton_kernels.head_inputs` computes): (ids shifted [R, T], the
    logits column of each row, forwards 2..k's first positions, drafting rows)."""
    R = ids.shape[0]
    col = torch.where(nxt != -1, n_real - 1, n_out - 1).clamp(min=0)
    drawn = tokens.gather(1, (n_out - 1).clamp(min=0).view(R, 1)).view(R)
    follow = torch.where(nxt >= 0, nxt, drawn)
    shifted = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter(1, col.view(R, 1), follow.view(R, 1))
    return shifted, col, start + col, ((nxt < 0) & (n_real > 0)).long()
