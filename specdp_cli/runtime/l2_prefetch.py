"""A weight on its way into L2 while the kernels before its GEMM leave the memory bandwidth idle (Hopper and newer).

At decode sizes a layer's GEMMs stream their weights from HBM, and the small ones start too slowly to stream at full
speed: on an H200 the 8B shape's FP8 o (16.8 MB) ran at 1.9 TB/s, 8.7 µs, where the device copies at about 4
(benchmarks/results/2026-12-02-h200-s22-*). The kernels between qkv and o (rotary and KV store, attention) read a few
hundred kilobytes in about 9 µs. `prefetch` starts copying o's weight into L2 (H200: 50 MB) at their start, with the
bulk-prefetch instruction (no registers, no waiting), so that o reads most of it from L2.

`_prefetch_kernel` takes part in programmatic dependent launch (pdl.py) as the small kernels do: it lets the next
kernel launch at its top and waits for the one before at its end. It reads nothing of the step (a weight is constant
between steps), so its prefetches may start before that wait. Shapes and these settings alone decide whether it
runs, so a CUDA graph captures what it replays.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

# o's weight prefetched after qkv at decode sizes (up to MAX_ROWS tokens a forward: verification rows included);
# benchmarks/fp8.py's "-prefetch" / "-noprefetch" rows and benchmarks/pdl_chain.py measure it
PREFETCH_O = True
MAX_ROWS = 128
PROGRAMS = 64            # programs issuing the prefetches: each SM's copy engine takes its program's share
LANES = 128


@triton.jit
def _prefetch_kernel(ptr, nbytes, chunk, LANES: tl.constexpr, PDL: tl.constexpr):
    # lane i of program p: bytes [(p * LANES + i) * chunk, + chunk) of the tensor (chunk a multiple of 16)
    pdl.launch_next(PDL)
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = lane.to(tl.int64) * chunk
    size = tl.minimum(chunk, nbytes - start)
    go = size > 0
    base = ptr.to(tl.pointer_type(tl.int8)) + tl.where(go, start, 0)
    tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, $3, 0;\n\t"
                              "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t}\n\tmov.u32 $0, 0;", "=r,l,r,r",
                              [base, tl.maximum(size, 16).to(tl.int32), go.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)
    pdl.wait_previous(PDL)


def supported(device: torch.device) -> bool:
    """Hopper's bulk prefetch: compute capability >= 9.0 (the kernels that take part in PDL need it too)."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SUPPORTED:
        _SUPPORTED[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _SUPPORTED[idx]


_SUPPORTED: dict = {}


def weight_tensor(w) -> torch.Tensor:
    """The tensor a linear layer's GEMM streams: a plain weight, or an FP8 weight's float8 values (models/quant.py)."""
    return w if isinstance(w, torch.Tensor) else w.weight


def prefetch(t: torch.Tensor, nbytes: int | None = None) -> None:
    """Start copying the first `nbytes` (default all; whole 16-byte pieces) of contiguous `t` into L2."""
    nbytes = (t.nbytes if nbytes is None else min(nbytes, t.nbytes)) // 16 * 16
    if nbytes == 0 or not t.is_contiguous() or t.data_ptr() % 16:
        return
    chunk = -(-nbytes // (PROGRAMS * LANES) // 16) * 16
    programs = triton.cdiv(nbytes, chunk * LANES)
    _prefetch_kernel[(programs,)](t, nbytes, chunk, LANES=LANES, num_warps=LANES // 32, **pdl.options(t.device))


def o_wanted(rows: int, w) -> bool:
    """Whether the decoder prefetches attention's output projection `w` after qkv for a forward of `rows` tokens."""
    return PREFETCH_O and 0 < rows <= MAX_ROWS and supported(weight_tensor(w).device)
