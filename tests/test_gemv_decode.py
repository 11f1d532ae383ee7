"""The runtime's matrix-vector kernel (specdp_cli/runtime/gemv_kernels.py, timed by benchmarks/gemv_decode.py)
under Triton's interpreter (TRITON_INTERPRET=1, CPU) against F.linear, float32 (the interpreter's bf16 is not the
GPU's; tests/test_gpu.py and the script check bf16 on the GPU): 1..8 tokens, N and K not multiples of the tiles
(masked K, clamped rows and tokens), the default tile and the sweep's kinds (several rows a program, the sum
deferred to after the loop), an x with a row stride (`interpreted_checks`, run in test_kernels_interpreted.py's
interpreter process); and the benchmark's tile plan."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def interpreted_checks() -> None:
    import torch
    import torch.nn.functional as F
    from specdp_cli.runtime import gemv_kernels as gd

    g = torch.Generator().manual_seed(0)
    cases = [(1, 37, 100, None), (3, 50, 70, None), (8, 64, 256, None), (5, 19, 300, (4, 64, 4, 2, False)),
             (2, 33, 129, (8, 32, 4, 3, True)), (7, 9, 40, (16, 16, 4, 2, True)), (6, 40, 96, (2, 32, 4, 1, False))]
    for M, N, K, tile in cases:
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
        out = gd.gemv(x, w, tile=tile)
        assert out.shape == (M, N) and out.dtype == torch.float32
        ref = F.linear(x, w)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4), (M, N, K, tile, (out - ref).abs().max())
    x, w = torch.randn(4, 200, generator=g), torch.randn(21, 150, generator=g)
    out = torch.full((4, 21), float("nan"))
    gd.gemv(x[:, 10:160], w, out)                               # row stride 200, written into a given buffer
    assert torch.allclose(out, F.linear(x[:, 10:160], w), rtol=1e-5, atol=1e-4)
    print("gemv interpreted: ok")


def test_plan_tiles():
    """The default tiles fit the register bound and take the unmasked K loop on every benchmarked shape; the sweep
    times the default once."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import gemv_decode as gd

    for shape, M, tiles in gd.plan(list(gd.SHAPES), [1, 2, 3, 4, 8], True):
        N, K = gd.SHAPES[shape]
        assert gd.tile_fits(M, tiles[0]) and K % tiles[0][1] == 0, (shape, M, tiles[0])
        assert len(set(tiles)) == len(tiles) and all(gd.tile_fits(M, t) for t in tiles)
