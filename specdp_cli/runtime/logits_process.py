"""What a request asks of the target's distribution besides temperature, top-k, top-p and min_p (those are
`sampling.probabilities`), as vLLM's logits processors: logit_bias, min_tokens, presence / frequency /
repetition penalties, and a grammar's token mask (structured output, `structured.py`).

They change the target's logits at every verified position of a step, before the rejection sampler. Position
j of a row follows the row's sequence and its drafts 0..j-1 (penalties count those drafts, min_tokens counts
them as generated, the grammar's state has consumed them), so each position gets exactly the distribution
plain decoding would sample from after accepting those drafts: verification stays lossless. A greedy row
takes the argmax of the adjusted logits; a draft the grammar forbids has probability 0 and is rejected there.
The drafter's own distribution is left alone: it only changes how many drafts are accepted.

`build` runs on the host, only in a step where some row asks for one of these (`SamplingParams.changes_logits`);
that step runs its forwards' graphs one by one and this adjustment eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request_params import SamplingParams
from .structured import draft_masks, verify_masks


@dataclass
class LogitsAdjust:
    bias: torch.Tensor | None                 # [R, V] added to every position of a row
    ban: tuple | None                         # (rows, positions, token ids): set to -inf (min_tokens' stop tokens)
    pen_rows: torch.Tensor | None             # [P] rows with penalties, and per such row:
    counts: torch.Tensor | None               # [P, V] its generated tokens' counts
    prompt_seen: torch.Tensor | None          # [P, V] tokens of its prompt (the repetition penalty's too)
    penalties: torch.Tensor | None            # [P, 3] presence, frequency, repetition
    grammar: list                             # (row, matcher, drafts it may check) of rows with a grammar
    V: int

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor, n_drafts: torch.Tensor) -> torch.Tensor:
        """logits [R, W, V] of the verified positions (float32 out), drafts [R, W - 1], n_drafts [R]."""
        raw = logits.float()
        R, W, V = raw.shape
        x = raw + self.bias[:R].unsqueeze(1) if self.bias is not None else raw.clone()     # changed in place below
        if self.ban is not None:
            x[self.ban] = float("-inf")
        if self.pen_rows is not None:
            x[self.pen_rows] = self._penalised(x[self.pen_rows], drafts[self.pen_rows], n_drafts[self.pen_rows])
        if self.grammar:
            allowed = self._grammar_mask(R, W, drafts, x.device)
            x = x.masked_fill(~allowed, float("-inf"))
            # a position min_tokens left nothing at (the grammar allows only a stop token there): the grammar wins
            dead = torch.isinf(x).all(-1, keepdim=True)
            x = torch.where(dead, raw.masked_fill(~allowed, float("-inf")), x)
        return x

    def _penalised(self, x: torch.Tensor, drafts: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """vLLM's order: repetition (prompt and generated tokens), then frequency and presence (generated)."""
        P, W, V = x.shape
        counts = self.counts.unsqueeze(1).repeat(1, W, 1)                     # [P, W, V]
        if W > 1:                                   # position j has also generated drafts 0..j-1
            i = torch.arange(W - 1, device=x.device).view(1, 1, -1)
            j = torch.arange(W, device=x.device).view(1, -1, 1)
            before = ((i < j) & (i < n.view(-1, 1, 1))).float()                # [P, W, W - 1]
            counts.scatter_add_(2, drafts.unsqueeze(1).expand(P, W, W - 1), before)
        presence, frequency, repetition = (self.penalties[:, c].view(P, 1, 1) for c in range(3))
        generated = counts > 0
        seen = generated | self.prompt_seen.unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        return x - frequency * counts - presence * generated.float()

    def _grammar_mask(self, R: int, W: int, drafts: torch.Tensor, device) -> torch.Tensor:
        """[R, W, V] allowed tokens. A grammar row's position j: its matcher after drafts 0..j-1 (each tried,
        then rolled back); positions after a draft the grammar forbids are never emitted (that draft is
        rejected): they allow everything. Other rows allow everything."""
        bits = torch.full((R * W, (self.V + 31) // 32), -1, dtype=torch.int32)
        host = drafts.cpu().tolist() if W > 1 else None            # the drafts are on the device: one sync
        verify_masks([(g, r * W, host[r][:n] if host is not None else []) for r, g, n in self.grammar], bits)
        return _unpack(bits, self.V, device).view(R, W, self.V)

    def mask_draft(self, logits: torch.Tensor, tokens: torch.Tensor, j: int) -> torch.Tensor:
        """A draft model's logits [R, Vd] for draft j (1-based) masked by each grammar row's state after its
        drafts 1..j-1 (`tokens` [R, >= j - 1] on the device: one sync), so its drafts follow the grammar and
        verification can accept them; the drafts' distribution is then the masked one (what the rejection
        sampler divides by). `end_drafting` rolls the grammars back."""
        R, Vd = logits.shape
        bits = torch.full((R, (self.V + 31) // 32), -1, dtype=torch.int32)
        prev = tokens[:, j - 2].cpu().tolist() if j > 1 else None
        draft_masks([(g, r, prev[r] if prev is not None else None) for r, g, n in self.grammar if j <= n], bits)
        allowed = _unpack(bits, self.V, logits.device)
        if Vd > self.V:                          # draft ids the target does not have: never verified
            allowed = torch.cat([allowed, allowed.new_zeros((R, Vd - self.V))], 1)
        return logits.masked_fill(~allowed[:, :Vd], float("-inf"))

    def end_drafting(self) -> None:
        for _, grammar, _ in self.grammar:
            grammar.end_drafting()

    def to(self, device) -> "LogitsAdjust":
        """A copy on `device` (a TP leader sends it to its followers; a grammar's matcher cannot travel: under
        tensor parallelism structured output is refused with the request)."""
        if self.grammar:
            raise RuntimeError("internal error: a grammar's logits adjustment cannot be sent to TP followers")

        def moved(t):
            return None if t is None else t.to(device)
        return LogitsAdjust(moved(self.bias), None if self.ban is None else tuple(moved(t) for t in self.ban),
                            moved(self.pen_rows), moved(self.counts), moved(self.prompt_seen), moved(self.penalties),
                            [], self.V)


def build(rows: list, R: int, V: int, eos: set[int], device) -> LogitsAdjust | None:
    """rows: (row index, RowSpec) of the step's rows that draw tokens and whose request asks for more than
    log-probabilities (`Request.special`). None when none asks for anything."""
    asking = [(i, r) for i, r in rows if r.seq.req.params.changes_logits]
    if not asking:
        return None
    bias = ban = pen_rows = counts = prompt_seen = penalties = None
    biased = [(i, r.seq.req.params.logit_bias) for i, r in asking if r.seq.req.params.logit_bias]
    if biased:
        rows_i = [i for i, b in biased for _ in b]
        ids = [int(t) for _, b in biased for t in b]
        vals = [float(v) for _, b in biased for v in b.values()]
        keep = [k for k, t in enumerate(ids) if t < V]        # ids past the model's logits: none to bias
        bias = torch.zeros((R, V), dtype=torch.float32)
        bias[[rows_i[k] for k in keep], [ids[k] for k in keep]] = torch.tensor([vals[k] for k in keep])
        bias = bias.to(device)
    banned = []
    for i, r in asking:
        p, done = r.seq.req.params, len(r.seq.generated)
        if p.min_tokens > done:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
            banned += [(i, j, t) for j in range(min(p.min_tokens - done, r.n_drafts + 1)) for t in stops if t < V]
    if banned:
        ban = tuple(torch.tensor(c, device=device) for c in zip(*banned))
    pen = [(i, r) for i, r in asking if _penalised(r.seq.req.params)]
    if pen:
        pen_rows = torch.tensor([i for i, _ in pen], device=device)
        gen = [r.seq.generated for _, r in pen]
        prompts = [r.seq.tokens[:r.seq.num_prompt] for _, r in pen]
        counts = _counts(gen, V, device)
        prompt_seen = _counts(prompts, V, device) > 0
        penalties = torch.tensor([[r.seq.req.params.presence_penalty, r.seq.req.params.frequency_penalty,
                                   r.seq.req.params.repetition_penalty] for _, r in pen], device=device)
    grammar = [(i, r.seq.req.grammar, r.n_drafts) for i, r in asking if r.seq.req.grammar is not None]
    return LogitsAdjust(bias, ban, pen_rows, counts, prompt_seen, penalties, grammar, V)


def _penalised(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def _counts(lists: list[list[int]], V: int, device) -> torch.Tensor:
    """[len(lists), V] float32: how often each token occurs in each list (ids past V are not counted)."""
    width = max(1, max(map(len, lists)))
    ids = torch.full((len(lists), width), V, dtype=torch.long)
    for k, toks in enumerate(lists):
        if toks:
            ids[k, :len(toks)] = torch.tensor(toks).clamp_(max=V)
    ids = ids.to(device)
    return torch.zeros((len(lists), V + 1), dtype=torch.float32, device=device).scatter_add_(
        1, ids, torch.ones_like(ids, dtype=torch.float32))[:, :V]


def _unpack(bits: torch.Tensor, V: int, device) -> torch.Tensor:
    """Token bitmasks [N, words] int32 (llguidance's layout: bit t % 32 of word t // 32) -> allowed [N, V] bool."""
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    bits = bits.to(device).unsqueeze(-1)
    return ((bits >> shifts) & 1).bool().flatten(1)[:, :V]
