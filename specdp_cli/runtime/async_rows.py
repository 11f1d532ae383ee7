"""Async scheduling's device side: what the host has not read yet about a step's rows goes to the next step's rows
on the device. After every step `record` keeps, per row (`Carry`): its last emitted token, how many of its drafts
verification rejected, the drafts proposed for its next step (an EAGLE head, an MTP layer) and what a draft model's
next first forward feeds (the one or two tokens it has not seen: the token drawn after the accepted drafts, and the
last draft when every one was accepted, with their first position). Before the next step's forwards `feed` gives
each staged row that names one of those rows (SRC = 1 + its index; 0: none) its first token, its drafts, its START
and FIRST moved back by the rejected drafts (the host counted every draft as accepted) and its drafter catch-up.
On CUDA one small Triton kernel each (`triton_kernels.feed_rows` / `record_rows`), elsewhere these torch
expressions, which the kernels are checked against."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Carry:
    """Per row of the step before: last token, drafts rejected (minus), proposals [rows, KMAX] (or None: the drafter
    proposes none) and a draft model's catch-up (or None: no draft model): first position, count, tokens [rows, 2]."""
    last: torch.Tensor
    short: torch.Tensor
    drafts: torch.Tensor | None = None
    catch_first: torch.Tensor | None = None
    catch_count: torch.Tensor | None = None
    catch_tokens: torch.Tensor | None = None

    @staticmethod
    def allocate(rows: int, k: int, proposes: bool, catches_up: bool, device) -> "Carry":
        z = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)   # noqa: E731
        return Carry(z(rows), z(rows), z(rows, k) if proposes and k else None,
                     *((z(rows), z(rows), z(rows, 2)) if catches_up else (None, None, None)))


# the staged table's columns `feed` and `record` read: ids, drafter ids, START, FIRST, NDRAFT, SRC, DSTART, DNREAL,
# DOUT, LEN (step_inputs.py)
Cols = tuple


def feed(rows: torch.Tensor, cols: Cols, c: Carry) -> None:
    """rows [R, width]: the staged step (changed in place)."""
    if rows.is_cuda:
        from .triton_kernels import feed_rows
        feed_rows(rows, rows.shape[0], cols, c)
        return
    c_ids, c_dids, c_start, c_first, c_ndraft, c_src, c_dstart, c_dnreal, c_dout, c_len = cols
    src = rows[:, c_src] - 1
    fed = src >= 0
    s = src.clamp(min=0)
    rows[:, c_ids] = torch.where(fed, c.last[s], rows[:, c_ids])
    back = torch.where(fed, c.short[s], 0)
    for col in (c_start, c_first, c_len):
        rows[:, col] += back
    for j in range(c.drafts.shape[1] if c.drafts is not None else 0):
        use = fed & (j < rows[:, c_ndraft])
        rows[:, c_ids + 1 + j] = torch.where(use, c.drafts[s, j], rows[:, c_ids + 1 + j])
    if c.catch_first is not None:
        catch = fed & (rows[:, c_dnreal] > 0)     # rows that feed the draft model (the host staged a catch-up)
        n = c.catch_count[s]
        for col, v in ((c_dstart, c.catch_first[s]), (c_dnreal, n), (c_dout, n - 1),
                       (c_dids, c.catch_tokens[s, 0]), (c_dids + 1, c.catch_tokens[s, 1])):
            rows[:, col] = torch.where(catch, v, rows[:, col])


def record(table: torch.Tensor, W: int, K: int, n_drafts: torch.Tensor, first: torch.Tensor, c: Carry) -> None:
    """table [R, W + 1 + K]: each row's tokens, their count n and K proposals; n_drafts, first [R]: the rows'
    NDRAFT and FIRST. With a = n - 1 accepted drafts and j0 = min(a, max(NDRAFT - 1, 0)) (the drafts the draft
    model was fed: all but the last), the catch-up is tokens j0..a at FIRST + j0."""
    if table.is_cuda:
        from .triton_kernels import record_rows
        record_rows(table, W, K, n_drafts, first, c)
        return
    R = table.shape[0]
    n = table[:, W]
    a = (n - 1).clamp(min=0)
    c.last[:R] = table.gather(1, a.view(R, 1)).view(R)
    c.short[:R] = n - 1 - n_drafts
    if c.drafts is not None and K:
        c.drafts[:R, :K] = table[:, W + 1:W + 1 + K]
    if c.catch_first is not None:
        j0 = torch.minimum(a, (n_drafts - 1).clamp(min=0))
        c.catch_first[:R] = first + j0
        c.catch_count[:R] = a - j0 + 1
        c.catch_tokens[:R, 0] = table.gather(1, j0.view(R, 1)).view(R)
        c.catch_tokens[:R, 1] = table.gather(1, torch.minimum(j0 + 1, a).view(R, 1)).view(R)
