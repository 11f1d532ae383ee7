"""Sampling: logits processing, counter-based random numbers, and the speculative verifier.

Randomness is a pure function of (request seed, token position, purpose), computed by an integer
hash on the device. A seeded request therefore gets the same tokens whatever batch, rank or step
it lands in — for the same k schedule: the accept/reject draws and residual tokens depend on the
drafts, so a k that varies with the batch or with timings (spec_length.py) can change sampled
tokens (greedy tokens never change) — and every draw of a step is made in one batched operation.

`verify` is the rejection sampler of Leviathan et al. (2023): draft x at a position is accepted
with probability min(1, p(x) / q(x)); at the first rejection a token is drawn from
normalize(max(p - q, 0)); if every draft is accepted a bonus token is drawn from p. Greedy rows
reduce to "accept while the draft equals the target's argmax" and emit the argmax.
"""
from __future__ import annotations

import torch

from ..request_params import SamplingParams  # noqa: F401 - the one definition; the engine's callers use it from here
from . import ops

MASK32 = 0xFFFFFFFF
STREAM_DRAFT, STREAM_ACCEPT, STREAM_TARGET = 1, 2, 3


# ---------------------------------------------------------------------------------------------
# counter-based uniforms

def _mix32(x: torch.Tensor) -> torch.Tensor:
    # multipliers below 2**31 keep every product inside int64, so no overflow is ever relied on
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x2C1B3C6D) & MASK32
    x = x ^ (x >> 16)
    return x


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in (0, 1), one per (seed, position) pair; seeds [R] broadcast against positions [R, ...]."""
    s = seeds.view(-1, *([1] * (positions.dim() - 1)))
    h = _mix32((s & MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((s >> 32) & MASK32))
    h = _mix32(h ^ (positions & MASK32) ^ 0x85EBCA6B)
    h = _mix32(h ^ (stream * 0x27D4EB2F & MASK32))
    return ((h >> 8).to(torch.float64) + 0.5).div_(1 << 24).to(torch.float32)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [..., V] (need not sum to 1), u [...] in (0, 1)."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


# ---------------------------------------------------------------------------------------------
# logits -> probabilities

def _host_flags(params: list[SamplingParams]) -> dict:
    """Decided on the host, so no step waits on the device for them."""
    return {"all_greedy": all(p.greedy for p in params),
            "filter": any(0 < p.top_k or p.top_p < 1 or p.min_p > 0 for p in params if not p.greedy)}


def row_tensors(params: list[SamplingParams], device, pad_to: int = 0) -> dict:
    """Per-row sampling settings as device tensors (one host-to-device copy; none at all when every
    row is greedy), plus the host flags. Rows past len(params), up to `pad_to`, are greedy padding."""
    return rows_on(*row_values(params, pad_to), device)


def row_values(params: list[SamplingParams], pad_to: int = 0) -> tuple[dict, tuple | None]:
    """`row_tensors`' sources on the host: (the host flags, (integers [pad_to, 3] int64, numbers [pad_to, 3]
    float64) or None when every row is greedy). A TP leader sends them to its followers."""
    flags = _host_flags(params)
    if flags["all_greedy"]:
        return flags, None
    # integers (top_k, seed: any int64) in one int64 tensor, numbers in one float64 tensor
    pad = pad_to - len(params)
    ints = torch.tensor([[int(p.greedy), min(p.top_k, 2 ** 31), p.seed] for p in params] + [[1, 0, 0]] * pad,
                        dtype=torch.long)
    nums = torch.tensor([[max(p.temperature, 1e-5), p.top_p, p.min_p] for p in params] + [[1.0, 1.0, 0.0]] * pad,
                        dtype=torch.float64)
    return flags, (ints, nums)


def rows_on(flags: dict, values: tuple | None, device) -> dict:
    """`row_values` as the sampler reads them: the flags and the per-row tensors on `device`."""
    rows = dict(flags)
    if values is None:
        return rows
    ints, nums = values[0].to(device), values[1].to(device)
    rows.update(greedy=ints[:, 0] > 0, temperature=nums[:, 0].float(), top_p=nums[:, 1].float(),
                min_p=nums[:, 2].float(), top_k=ints[:, 1], seed=ints[:, 2])
    return rows


def probabilities(logits: torch.Tensor, rows: dict) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p per row (vLLM's order). logits [R, P, V] -> probs [R, P, V]."""
    V = logits.shape[-1]
    x = logits.float() / rows["temperature"].view(-1, 1, 1)     # (the runners keep logits in the model's dtype)
    top_k, top_p = rows["top_k"], rows["top_p"]
    if rows["filter"]:
        # min-p: tokens less likely than min_p x the most likely one are dropped
        p = torch.softmax(x, -1)
        x = x.masked_fill(p < rows["min_p"].view(-1, 1, 1) * p.amax(-1, keepdim=True), float("-inf"))
        sorted_x, order = x.sort(-1, descending=True)
        rank = torch.arange(V, device=x.device).view(1, 1, V)
        k = torch.where(top_k > 0, top_k, V).view(-1, 1, 1)
        drop = rank >= k
        sorted_p = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), -1)
        before = sorted_p.cumsum(-1) - sorted_p            # mass strictly above each token
        drop = drop | (before >= top_p.view(-1, 1, 1))     # keeps the smallest prefix reaching top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, sorted_x)
    return torch.softmax(x, -1)


# ---------------------------------------------------------------------------------------------
# verification

def verify(target_logits: torch.Tensor, drafts: torch.Tensor, n_drafts: torch.Tensor,
           draft_probs: torch.Tensor | None, rows: dict, first_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject the drafts of R rows and draw each row's next token.

    target_logits [R, K+1, V]: row r's logits at its K+1 verified positions (only n_drafts[r] + 1 used)
    drafts [R, K] long, n_drafts [R] long; draft_probs [R, K, V] the distribution each draft was drawn
    from, or None where drafts are deterministic (q one-hot: ngram, or greedy drafting);
    rows: `row_tensors` of the R rows; first_pos [R] long: sequence position of row r's first new token.
    Returns (tokens [R, K+1], n_out [R]): row r emits tokens[r, :n_out[r]] = accepted drafts + one.
    """
    R, K1, V = target_logits.shape
    K = K1 - 1
    dev = target_logits.device
    j = torch.arange(K, device=dev).view(1, K)
    valid = j < n_drafts.view(-1, 1)
    tokens = ops.argmax(target_logits)                                     # greedy answer
    if K == 0 and rows["all_greedy"]:       # plain decoding: one token a row (two small kernels fewer)
        return tokens, torch.ones(R, dtype=torch.long, device=dev)
    accept = (drafts == tokens[:, :K]) & valid
    n_acc = accept.long().cumprod(-1).sum(-1)
    if rows["all_greedy"]:
        return tokens, n_acc + 1
    greedy = rows["greedy"]

    p = probabilities(target_logits, rows)                                 # [R, K+1, V]
    positions = first_pos.view(-1, 1) + torch.arange(K1, device=dev).view(1, K1)
    p_draft = p[:, :K].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)       # [R, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = uniforms(rows["seed"], positions[:, :K], STREAM_ACCEPT)
    r_accept = (u * q_draft < p_draft) & valid
    r_n_acc = r_accept.long().cumprod(-1).sum(-1)                          # [R]

    # the next token: from the residual at the first rejection, or a bonus from p after all accepted
    idx = r_n_acc.view(-1, 1, 1).expand(-1, 1, V)
    p_at = p.gather(1, idx).squeeze(1)                                     # [R, V]
    rejected = r_n_acc < n_drafts
    if draft_probs is None:
        q_at = torch.zeros_like(p_at)
        at = drafts.gather(1, r_n_acc.clamp(max=max(K - 1, 0)).view(-1, 1)) if K else None
        if at is not None:
            q_at.scatter_(1, at, 1.0)
    else:
        q_pad = torch.cat([draft_probs, torch.zeros_like(p_at).unsqueeze(1)], 1)
        q_at = q_pad.gather(1, idx).squeeze(1)
    residual = torch.clamp(p_at - q_at, min=0)
    empty = residual.sum(-1, keepdim=True) <= 0                           # p == q exactly: use p
    residual = torch.where(empty, p_at, residual)
    dist = torch.where(rejected.view(-1, 1), residual, p_at)
    u_next = uniforms(rows["seed"], positions.gather(1, r_n_acc.view(-1, 1)).squeeze(1), STREAM_TARGET)
    nxt = sample_from(dist, u_next)

    r_tokens = torch.cat([drafts, drafts[:, :1]], 1).clone() if K else nxt.view(-1, 1).clone()
    r_tokens.scatter_(1, r_n_acc.view(-1, 1), nxt.view(-1, 1))
    out = torch.where(greedy.view(-1, 1), tokens, r_tokens)
    n_out = torch.where(greedy, n_acc, r_n_acc) + 1
    return out, n_out


def draw(logits: torch.Tensor, rows: dict, positions: torch.Tensor,
         stream: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draw one token per row from logits [R, V] (drafting). Returns (tokens [R], probs [R, V] or
    None when every row is greedy)."""
    arg = ops.argmax(logits)
    if rows["all_greedy"]:
        return arg, None
    greedy = rows["greedy"]
    probs = probabilities(logits.unsqueeze(1), rows).squeeze(1)
    tok = sample_from(probs, uniforms(rows["seed"], positions, stream))
    probs = torch.where(greedy.view(-1, 1), torch.nn.functional.one_hot(arg, probs.shape[-1]).to(probs.dtype), probs)
    return torch.where(greedy, arg, tok), probs
