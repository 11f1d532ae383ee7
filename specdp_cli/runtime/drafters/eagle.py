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

    def host_drafts(self, rows, n_forwards) -> Drafts:
        n = [min(ke, len(s.next_drafts)) for s, ke in rows]
        return Drafts(n, [s.next_drafts[:m] for (s, _), m in zip(rows, n)])

    def propose_after(self, ctx, tokens: torch.Tensor, n_out: torch.Tensor) -> torch.Tensor:
        """tokens [R, W], n_out [R]: what verification emitted. Returns the next step's drafts [R, K]."""
        sz, inp, r, t = ctx.sizes, ctx.inputs, self.runner, self.target
        R, T, K = sz.R_pad, sz.T, sz.K
        n_real, nxt, start = inp.col(NREAL, R), inp.col(NEXT, R), inp.col(START, R)
        prompt_row = nxt != -1
        col = torch.where(prompt_row, n_real - 1, n_out - 1).clamp(min=0)
        drawn = tokens.gather(1, (n_out - 1).clamp(min=0).view(R, 1)).view(R)
        follow = torch.where(nxt >= 0, nxt, drawn)
        ids = t.ids[:R * T].view(R, T)
        shifted = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter(1, col.view(R, 1), follow.view(R, 1))
        ctx.publish(f"drafter forward 1/{max(K, 1)}")
        self.head.prepare_features(R * T)
        r.set_rows(R, shifted, start, n_real, col)
        d = ops.argmax(r.forward(R, T, ctx.graphs)[:, 0])
        drafts = torch.zeros((R, K), dtype=torch.long, device=r.device)
        if not K:           # a step with k = 0: the head still learns the verified positions, drafts nothing
            return drafts
        drafts[:, 0] = d
        drafting = ((nxt < 0) & (n_real > 0)).long()          # decode rows and rows ending a prompt
        if K > 1:     # forwards 2..K: the rows' positions advance by one in place (from start + col + 1)
            r.set_rows(R, start=start + col, n_real=drafting, out_start=self._zeros[:R])
        for j in range(2, K + 1):
            ctx.publish(f"drafter forward {j}/{K}")
            self.head.feats[:R].copy_(r.hidden[:R])            # the predicted feature is the next input's
            r.start[:R].add_(1)
            r.set_rows(R, d.view(R, 1))
            d = ops.argmax(r.forward(R, 1, ctx.graphs)[:, 0])
            drafts[:, j - 1] = d
        return drafts
