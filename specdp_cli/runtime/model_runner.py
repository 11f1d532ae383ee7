"""One model (target or drafter) with its KV cache: the forwards of a step.

Every forward is *uniform*: R rows of T tokens each. A row is a run of one sequence's tokens at
rising positions — a decode row (the last token and its drafts), or a piece of a prompt chunk (a
chunk longer than T takes several rows of the same sequence; every row's keys and values are
stored before attention runs, so later rows see earlier ones). Row r's token t sits at position
start[r] + t; tokens t >= n_real[r] are padding (they write to the trash block and their outputs
are ignored).

The inputs live in persistent buffers that the caller fills on the device (`ids`, `start`,
`n_real`, `out_start`, and the engine's shared block table); positions, cache slots and padding
are derived from them on the device. On CUDA each (R, T) replays a CUDA graph captured at
start-up; the key is a padded row count and a token count per row, never a sequence length
(attention reads lengths from the positions and block tables).

Logits come back for a window of `window` tokens per row starting at out_start[r]: the target
returns k + 1 per row (it verifies each draft; a prompt's last row starts its window at the last
real token), a drafter one per row (the token it proposes from).
"""
from __future__ import annotations

import torch

from .kv_cache import TRASH_BLOCK
from .ops import AttnMeta


def capture_sizes(max_rows: int) -> list[int]:
    """Padded row counts with a graph each: 1, 2, 4, 8, then steps of 8, 16 and 32 (vLLM-like), up to
    the first size that holds max_rows."""
    sizes, s = [], 1
    while True:
        sizes.append(s)
        if s >= max_rows:
            return sizes
        s = s * 2 if s < 8 else s + (8 if s < 32 else 16 if s < 128 else 32)


def pad_rows(n: int, sizes: list[int]) -> int:
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} rows exceed the largest forward ({sizes[-1]} rows)")


class ModelRunner:
    def __init__(self, model, device: torch.device, block_table: torch.Tensor, block_size: int,
                 max_rows: int, t_values: list[int], window: int, keep_hidden: str | None = None):
        """keep_hidden: "all" keeps every token's final hidden state in `hidden` [R * T, h] (the target,
        for an EAGLE head), "window" those of the logits window [R * window, h] (an EAGLE head, whose
        predicted feature feeds its next forward)."""
        self.model = model
        self.device = device
        self.block_table = block_table            # [rows, max_blocks] int32, shared with the other runner
        self.block_size = block_size
        self.t_values = sorted(set(t_values))
        self.window = window
        T = max(self.t_values)
        self.ids = torch.zeros(max_rows * T, dtype=torch.long, device=device)
        self.start = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.n_real = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.out_start = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._t = torch.arange(T, device=device)
        # CUDA: the Triton kernels of `_layout` and `set_rows` (CPU: their torch references)
        self._forward_layout = self._set_rows = None
        if device.type == "cuda":
            from .triton_kernels import forward_layout, set_rows
            self._forward_layout, self._set_rows = forward_layout, set_rows
        self._pos = torch.zeros(max_rows * T, dtype=torch.long, device=device)
        self._slots = torch.zeros(max_rows * T, dtype=torch.long, device=device)
        self._out_rows = torch.zeros(max_rows * window, dtype=torch.long, device=device)
        self._rows = torch.arange(max_rows, device=device)
        # in the model's dtype, as the LM head computes them: greedy steps take the argmax of these, no float
        # copy (a kernel and 0.4 us of gap a step on an H200); probabilities are computed in float32 (`sampling`)
        self.logits_out = torch.zeros((max_rows * window, model.vocab_size), dtype=model.dtype, device=device)
        self.keep_hidden = keep_hidden
        rows_kept = {"all": max_rows * T, "window": max_rows * window}.get(keep_hidden or "", 0)
        self.hidden = torch.zeros((rows_kept, model.embed.shape[1]), dtype=model.dtype, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def set_rows(self, R: int, ids=None, start=None, n_real=None, out_start=None) -> None:
        """Fill the first R rows' inputs (device tensors; ids [R, T] fill the first T columns). On CUDA one kernel
        (a copy each is a kernel and a launch gap each forward)."""
        if self._set_rows is not None:
            self._set_rows(R, self.ids, self.start, self.n_real, self.out_start, ids, start, n_real, out_start)
            return
        if ids is not None:
            T = ids.shape[1]
            self.ids[:R * T].view(R, T).copy_(ids)
        for buf, src in ((self.start, start), (self.n_real, n_real), (self.out_start, out_start)):
            if src is not None:
                buf[:R].copy_(src)

    def forward(self, R: int, T: int, graphs: bool = True) -> torch.Tensor:
        """Logits [R, window, V] of the forward over the first R rows of the buffers."""
        g = self.graphs.get((R, T)) if graphs else None
        if g is not None:
            g.replay()
            return self.logits_out[:R * self.window].view(R, self.window, -1)
        return self._forward(R, T)

    def _forward(self, R: int, T: int) -> torch.Tensor:
        positions, slots, out_rows = self._layout(R, T)
        meta = AttnMeta(positions, slots, self.block_table[:R], T)
        hidden = self.model.forward(self.ids[:R * T], meta)
        if self.keep_hidden == "all":
            self.hidden[:R * T].copy_(hidden)
        W = self.window
        hidden = hidden.index_select(0, out_rows)     # (on an H200 a faster kernel than hidden[out_rows])
        if self.keep_hidden == "window":
            self.hidden[:R * W].copy_(hidden)
        out = self.logits_out[:R * W]
        logits = self.model.logits(hidden, out)      # the plain LM head writes into `out`: no copy kernel
        if logits is not out:
            out.copy_(logits)
        return out.view(R, W, -1)

    def _layout(self, R: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's position and cache slot [R * T], and the token rows of the logits window [R * W]."""
        W, BS = self.window, self.block_size
        if self._forward_layout is not None:
            pos, slots, rows = self._pos[:R * T], self._slots[:R * T], self._out_rows[:R * W]
            self._forward_layout(self.start[:R], self.n_real[:R], self.out_start[:R], self.block_table[:R], T, W,
                                 BS, TRASH_BLOCK, pos, slots, rows)
            return pos, slots, rows
        start = self.start[:R].clamp(min=0).view(R, 1)
        n_real = self.n_real[:R].view(R, 1)
        last = (n_real - 1).clamp(min=0)
        t = self._t[:T].view(1, T)
        pos = start + torch.minimum(t, last)                                   # padding repeats the last position
        bt = self.block_table[:R]
        blk = bt.gather(1, (pos // BS).clamp(max=bt.shape[1] - 1)).long()
        slots = torch.where(t < n_real, blk * BS + pos % BS, TRASH_BLOCK * BS)
        cols = (self.out_start[:R].view(R, 1) + self._t[:W].view(1, W)).clamp(max=T - 1)
        return pos.view(-1), slots.view(-1), (self._rows[:R].view(R, 1) * T + cols).view(-1)

    def capture(self, sizes: dict[int, list[int]], pool, mode: str = "global") -> int:
        """Capture a CUDA graph per (padded rows, T) — sizes[T] lists the row counts — largest first,
        in the engine's memory pool. Each key is run once eagerly first (kernel compilation, library
        workspaces). `mode`: torch.cuda.graph's capture_error_mode. Returns the graph count."""
        for T in self.t_values:
            for R in sorted(sizes[T], reverse=True):
                self._forward(R, T)
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, capture_error_mode=mode):
                    self._forward(R, T)
                self.graphs[(R, T)] = g
        torch.cuda.synchronize(self.device)
        return len(self.graphs)
