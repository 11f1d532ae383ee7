"""The rotary / norm and routed-expert Triton kernels under Triton's interpreter (TRITON_INTERPRET=1, CPU) against
the torch paths CPU runs: Qwen3's per-head q/k norms inside the rotary-and-store kernel, and the routed experts with
a token's experts partly held elsewhere (expert parallelism). float32 (the interpreter's bf16 dot is not the GPU's:
tests/test_gpu.py checks bf16 there)."""
import os
import subprocess
import sys
from pathlib import Path

import torch


def interpreted_checks() -> None:
    from specdp_cli.runtime import ops, triton_kernels as tk
    from specdp_cli.runtime.moe_kernels import routed_experts

    g = torch.Generator().manual_seed(0)
    H, KV, D, BS, NB = 4, 2, 64, 16, 12
    qkv = torch.randn(9, (H + 2 * KV) * D, generator=g)
    qw, kw = torch.randn(D, generator=g), torch.randn(D, generator=g)
    cos, sin = torch.randn(200, D // 2, generator=g), torch.randn(200, D // 2, generator=g)
    pos, slots = torch.randint(0, 200, (9,), generator=g), torch.randperm(NB * BS, generator=g)[:9]
    for norms in (None, (qw, kw, 1e-6)):
        ref, kc, vc = qkv.clone(), torch.zeros(NB, BS, KV, D), torch.zeros(NB, BS, KV, D)
        ops.rope_and_store(ref, cos, sin, ops.AttnMeta(pos, slots, None), kc, vc, H, KV, D, norms)   # torch path
        out, k2, v2 = qkv.clone(), torch.zeros_like(kc), torch.zeros_like(vc)
        tk.rope_and_store(out, cos, sin, pos, slots, k2, v2, H, KV, D, norms)
        for a, b in ((out, ref), (k2, kc), (v2, vc)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (norms is not None, (a - b).abs().max())

    N, hidden, inter, E, K = 5, 64, 32, 16, 4
    x = torch.randn(N, hidden, generator=g)
    gate_up, down = torch.randn(E, 2 * inter, hidden, generator=g) / 8, torch.randn(E, hidden, inter, generator=g) / 8
    w = torch.rand(N, K, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    idx[1, 2], idx[3, 0] = -1, E + 2                      # experts held on another rank
    ref = torch.zeros_like(x)
    for t in range(N):
        for j in range(K):
            e = int(idx[t, j])
            if 0 <= e < E:
                a = x[t] @ gate_up[e].T
                ref[t] += w[t, j] * ((torch.nn.functional.silu(a[:inter]) * a[inter:]) @ down[e].T)
    out = routed_experts(x, w, idx, gate_up, down)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (out - ref).abs().max()
    print("interpreted kernels: ok")


def test_kernels_under_the_triton_interpreter():
    here = Path(__file__).parent
    code = (f"import sys; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; import test_kernels_interpreted as t; "
            f"t.interpreted_checks()")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
