"""Programmatic dependent launch (PDL; Hopper and newer) for the step's small Triton kernels.

A decode step at small batch is hundreds of short kernels back to back: each starts only once the one before it
has finished and its writes are flushed, then pays its own launch and set-up. With PDL a kernel may start while
the kernel before it in the stream still runs:

- `begin(PDL)` at a kernel's top: lets the next kernel launch at once (`griddepcontrol.launch_dependents`), then
  waits until the kernel before this one has finished and its writes are visible (`griddepcontrol.wait`).
  Nothing of a step is read or written before that wait; every program of every PDL kernel waits (a kernel that
  ended without waiting could let the next one run before the one before it had finished).
- The norms, rotary, attention, quantization, activation and MoE routing / expert kernels take part. The GEMMs
  (fp8_kernels._gemm_kernel, gemv_kernels._gemv_kernel) launch plainly by default (GEMM_TRIGGER "off"): launched
  early, their programs sat waiting on the SMs that had room while the kernel before ran, and a GEMM that streams
  weights over every SM lost more than the launch it saved. benchmarks/pdl_chain.py (H200, an 8B-shaped FP8 layer
  chain x 32 in a graph, µs a replay at batch 1 / 16): plain 2,502 / 2,746; PDL with the GEMMs launched plainly
  2,533 / 2,689; GEMMs letting the next kernel launch at their start 3,205 / 3,756, after their main loop 2,587 /
  3,469; prefetching their first weight bytes into L2 before the wait (`prefetch_rows`, PREFETCH) lost more at
  batch 1. End to end (benchmarks/fp8.py, the same call): the 8B shape +4 % (FP8) and +5 % (bf16) at batch 1 and
  16, the Qwen3-30B-A3B shape (8 layers) +11 % in bf16 and -9 % in FP8.

A kernel launched after one that does not take part (a torch, cuBLAS or NCCL kernel) starts when that one ends, as
without PDL. Off CUDA (Triton's interpreter), before compute capability 9.0, or with ENABLED False (benchmarks
measure both), the kernels run as before: PDL False and no launch option. A CUDA graph captures the launches
with their programmatic edges.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ENABLED = True
PREFETCH = True         # the GEMMs' weight prefetch before the wait, where GEMMs take part (GEMM_TRIGGER not "off")
_SUPPORTED: dict = {}


def enabled(device: torch.device) -> bool:
    """Whether the kernels on `device` launch with PDL (shapes and settings alone: a graph replays what it captured)."""
    if not ENABLED or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SUPPORTED:
        _SUPPORTED[idx] = (torch.cuda.get_device_capability(idx)[0] >= 9
                           and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait"))
    return _SUPPORTED[idx]


def options(device: torch.device) -> dict:
    """A kernel launch's keyword arguments: the PDL constexpr and Triton's launch option."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}


# The routed-expert kernels (moe_kernels._up_kernel / _down_kernel) stream weights as the GEMMs do, but take part
# by default: the Qwen3-30B-A3B shape gained 11 % in bf16 with them taking part. In FP8 it lost 9 %; an FP8 tile
# needs half the shared memory, so more of their programs fit an SM and early-launched ones may crowd onto a few
# (what slowed the GEMMs). True: they launch plainly (benchmarks/fp8.py's "-expertsplain" rows).
EXPERTS_PLAIN = False


def expert_options(device: torch.device) -> dict:
    """`options` for the routed-expert kernels (plain launches where EXPERTS_PLAIN)."""
    return {"PDL": False} if EXPERTS_PLAIN else options(device)

# Where a GEMM lets the next kernel launch: "start" (at its top, as the small kernels do), "end" (after its main
# loop), or "off" (GEMMs launched plainly: the fastest, measured by benchmarks/pdl_chain.py; module docstring).
GEMM_TRIGGER = "off"


def gemm_options(device: torch.device) -> dict:
    """`options` for the GEMM kernels (fp8_kernels._gemm_kernel, gemv_kernels._gemv_kernel), with LATE: whether
    they let the next kernel launch only after their main loop."""
    if GEMM_TRIGGER == "off":
        return {"PDL": False, "LATE": False}
    return {**options(device), "LATE": GEMM_TRIGGER == "end"}


@triton.jit
def launch_next(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_previous(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def begin(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the one before (no-ops unless PDL)."""
    launch_next(PDL)
    wait_previous(PDL)


@triton.jit
def prefetch_rows(ptr, first_row, n_rows, row_stride, col0, nbytes, ROWS: tl.constexpr, LANES: tl.constexpr):
    """Start copying bytes [col0, col0 + nbytes) of rows first_row .. first_row + ROWS - 1 (those below n_rows) of a
    row-major matrix at `ptr` (row_stride, col0 and nbytes in bytes, multiples of 16; the rows 16-byte aligned) into
    L2 without waiting (Hopper's bulk prefetch). Each of LANES lanes (the program's threads: one instruction each)
    takes a part of a row: a lane per (row, part), never two lanes the same bytes."""
    PARTS: tl.constexpr = LANES // ROWS if LANES > ROWS else 1
    lane = tl.arange(0, LANES)
    row = first_row + lane % ROWS
    part = lane // ROWS
    chunk = tl.maximum(nbytes // PARTS // 16 * 16, 16)
    start = part * chunk
    size = tl.where(part == PARTS - 1, nbytes - start, tl.minimum(chunk, nbytes - start))
    go = (row < n_rows) & (part < PARTS) & (size > 0)
    base = ptr.to(tl.pointer_type(tl.int8)) + tl.where(go, row, 0).to(tl.int64) * row_stride + col0 + start
    tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $3, 0;\n\t"
                              "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t}\n\tmov.u32 $0, 0;", "=r,l,r,r",
                              [base, tl.maximum(size, 16), go.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
