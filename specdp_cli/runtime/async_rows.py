"""Async scheduling's device side: what the host has not read yet about a step's rows goes to the next step's rows
on the device. After every step `record` keeps, per row, its last emitted token, how many of its drafts
verification rejected, and the drafts proposed for its next step (an EAGLE head, an MTP layer); before the next
step's forwards `feed` gives each staged row that names one of those rows (SRC = 1 + its index; 0: none) its
first token, its drafts, and its START and FIRST moved back by the rejected drafts (the host counted every draft
as accepted). On CUDA one small Triton kernel each (`triton_kernels.feed_rows` / `record_rows`), elsewhere these
torch expressions, which the kernels are checked against."""
from __future__ import annotations

import torch


def feed(rows: torch.Tensor, cols: tuple, last: torch.Tensor, short: torch.Tensor,
         drafts: torch.Tensor | None) -> None:
    """rows [R, width]: the staged step (changed in place); cols: its (ids, START, FIRST, NDRAFT, SRC) columns;
    last, short [rows] and drafts [rows, KMAX] (or None): what `record` kept of the step before."""
    if rows.is_cuda:
        from .triton_kernels import feed_rows
        feed_rows(rows, rows.shape[0], cols, last, short, drafts)
        return
    c_ids, c_start, c_first, c_ndraft, c_src = cols
    src = rows[:, c_src] - 1
    fed = src >= 0
    s = src.clamp(min=0)
    rows[:, c_ids] = torch.where(fed, last[s], rows[:, c_ids])
    back = torch.where(fed, short[s], 0)
    rows[:, c_start] += back
    rows[:, c_first] += back
    for j in range(drafts.shape[1] if drafts is not None else 0):
        use = fed & (j < rows[:, c_ndraft])
        rows[:, c_ids + 1 + j] = torch.where(use, drafts[s, j], rows[:, c_ids + 1 + j])


def record(table: torch.Tensor, W: int, K: int, n_drafts: torch.Tensor, last: torch.Tensor, short: torch.Tensor,
           drafts: torch.Tensor | None) -> None:
    """table [R, W + 1 + K]: each row's tokens, their count n and K proposals; n_drafts [R]: the row's NDRAFT.
    Writes last[r] = its last emitted token, short[r] = n - 1 - NDRAFT[r] (minus the rejected drafts) and
    drafts[r, :K] = its proposals."""
    if table.is_cuda:
        from .triton_kernels import record_rows
        record_rows(table, W, K, n_drafts, last, short, drafts)
        return
    R = table.shape[0]
    n = table[:, W]
    last[:R] = table.gather(1, (n - 1).clamp(min=0).view(R, 1)).view(R)
    short[:R] = n - 1 - n_drafts
    if drafts is not None and K:
        drafts[:R, :K] = table[:, W + 1:W + 1 + K]
