"""Block-scaled FP8 checkpoints (DeepSeek-V3's and Qwen3-FP8's layout: float8_e4m3fn weights with a
`weight_scale_inv` per block, embeddings, norms, LM head and routers unquantized, per-expert tensors): specdp
dequantizes them at load, so greedy float32 tokens equal transformers' on a dequantized copy of the checkpoint,
with speculation on; preflight accepts them and says FP8 and what stays in high precision; other quantizations are
refused with a sentence."""
import json
from pathlib import Path

import pytest
import torch

from dp_util import dp_config
from engine_util import check_against_reference, make_config, make_engine, prompts_of_lengths, run_engine
from helpers import make_deepseek_dir, make_model_dir, make_moe_dir

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]
FP8_MAX = 448.0          # float8_e4m3fn's largest finite value


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8 weight, float32 scales [ceil(out / bm), ceil(in / bn)]), as the published
    checkpoints hold them: each block's scale is its largest magnitude over FP8's largest value."""
    bm, bn = block
    out, inp = w.shape
    R, C = -(-out // bm), -(-inp // bn)
    padded = torch.zeros(R * bm, C * bn)
    padded[:out, :inp] = w.float()
    blocks = padded.view(R, bm, C, bn)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).view(R * bm, C * bn)[:out, :inp].to(torch.float8_e4m3fn)
    return q, scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bm, bn = block
    s = scale.repeat_interleave(bm, 0)[:q.shape[0]].repeat_interleave(bn, 1)[:, :q.shape[1]]
    return q.float() * s


def _quantized(name: str, t: torch.Tensor) -> bool:
    """Which tensors the published FP8 checkpoints quantize: the linear layers' weights, not the embedding, the
    LM heads, the routers or the norms."""
    return (name.endswith(".weight") and t.dim() >= 2 and "embed_tokens" not in name and "lm_head" not in name
            and not name.endswith("mlp.gate.weight") and "shared_head.head" not in name and "norm" not in name)


def fp8_pair(src: Path, block: tuple[int, int]) -> tuple[Path, Path]:
    """From the float32 checkpoint `src`: an FP8 checkpoint in the published layout (fused experts split per
    expert: mlp.experts.{e}.gate_proj / up_proj / down_proj) and a float32 reference holding exactly the weights
    it dequantizes to (transformers' layout, the config without quantization_config)."""
    from safetensors.torch import load_file, save_file
    import shutil

    fp8_dir, ref_dir = src.parent / (src.name + "-fp8"), src.parent / (src.name + "-dequantized")
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d)
        for f in d.glob("*.safetensors"):
            f.unlink()
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    fp8, ref = {}, {}
    for name, t in sd.items():
        if not _quantized(name, t):
            fp8[name] = ref[name] = t
            continue
        if t.dim() == 3:                   # transformers 5's fused experts -> the published per-expert tensors
            base = name[:-len("experts.gate_up_proj")] if name.endswith("gate_up_proj") else None
            deq = []
            for e in range(t.shape[0]):
                parts = t[e].chunk(2, 0) if base is not None else [t[e]]
                names = ([f"{base}experts.{e}.gate_proj.weight", f"{base}experts.{e}.up_proj.weight"] if base is not None
                         else [f"{name[:-len('experts.down_proj')]}experts.{e}.down_proj.weight"])
                rows = []
                for n, p in zip(names, parts):
                    q, s = _quantize(p, block)
                    fp8[n], fp8[n + "_scale_inv"] = q, s
                    rows.append(_dequantize(q, s, block))
                deq.append(torch.cat(rows, 0))
            ref[name] = torch.stack(deq).to(t.dtype)
            continue
        q, s = _quantize(t, block)
        fp8[name], fp8[name + "_scale_inv"] = q, s
        ref[name] = _dequantize(q, s, block).to(t.dtype)
    save_file(fp8, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return fp8_dir, ref_dir


@pytest.fixture(scope="module")
def fp8(tmp_path_factory, models):
    """Llama (128 x 128 blocks: one per matrix here), Qwen3-MoE (16 experts, top 4; 16 x 32 blocks, partial ones
    at the edges) and DeepSeek-V3 with its MTP layer (32 x 16 blocks): each as (FP8, dequantized reference)."""
    root = tmp_path_factory.mktemp("fp8")
    tok = models["tokenizer"]
    return {"llama": fp8_pair(make_model_dir(root / "llama", tok, layers=2, seed=11), (128, 128)),
            "qwen3_moe": fp8_pair(make_moe_dir(root / "qwen3moe", tok, "qwen3_moe", seed=5, experts=16, top_k=4,
                                               hidden=48, norm_topk_prob=True), (16, 32)),
            "deepseek_v3": fp8_pair(make_deepseek_dir(root / "deepseek", tok, seed=3, experts=8, top_k=2, n_group=2,
                                                      topk_group=1), (32, 16))}


def test_checkpoint_is_in_the_published_layout(fp8):
    from safetensors import safe_open

    path, _ = fp8["qwen3_moe"]
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
        w = fh.get_tensor("model.layers.0.mlp.experts.3.gate_proj.weight")
        s = fh.get_tensor("model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv")
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert s.shape == (-(-w.shape[0] // 16), -(-w.shape[1] // 32))
        for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight"):
            assert fh.get_tensor(kept).dtype == torch.float32 and kept + "_scale_inv" not in names


@pytest.mark.parametrize("family,method", [("llama", "draft_model"), ("qwen3_moe", "draft_model"),
                                           ("qwen3_moe", "ngram"), ("deepseek_v3", "mtp"),
                                           ("deepseek_v3", "draft_model")])
def test_greedy_equals_transformers_on_the_dequantized_weights(models, fp8, family, method):
    path, ref = fp8[family]
    M = 64
    cfg, plan = make_config(path, models["draft"] if method == "draft_model" else None, method=method, k=3, M=M,
                            max_num_seqs=4, max_batched=24)
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=6)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(ref, done, prompts, 30, M, f"{family}-fp8")
    assert engine.counters.spec.num_drafts > 0 or method == "none"


def test_validate_config_reports_fp8(tmp_path, models, fp8):
    from dp_util import run_cli

    path, _ = fp8["deepseek_v3"]
    cfg = dp_config(tmp_path, path, None, dp=1, dp_sync="auto", method="mtp", k=2, M=64)
    r, _ = run_cli("validate", "config", cfg, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is True
    q = out["quantization"]
    assert q["method"] == "fp8" and q["weight_block_size"] == [32, 16] and q["loaded_as"] == "float32"
    assert "model.embed_tokens.weight" in q["high_precision"] and "lm_head.weight" in q["high_precision"]
    assert "model.layers.*.mlp.gate.weight" in q["high_precision"]
    detail = {c["name"]: c["detail"] for c in out["checks"]}
    assert "FP8" in detail["files"] and "32x16 block" in detail["files"]
    assert "dequantized to float32" in detail["memory"] and "lm_head.weight" in detail["memory"]
    # weights as loaded: dequantized to float32, 4 bytes a parameter (the scales are not kept)
    from specdp_cli.modeldir import ModelDir
    md = ModelDir.open(str(path), "model")
    params = sum(torch.Size(shape).numel() for n, (_, shape) in md.tensor_headers.items()
                 if not n.endswith("_scale_inv"))
    assert md.weight_bytes("float32") == params * 4


@pytest.mark.parametrize("quant,why", [
    ({"quant_method": "awq", "bits": 4}, "quantized checkpoints (awq) are not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme"),
])
def test_other_quantizations_are_refused(tmp_path, models, fp8, quant, why):
    import shutil

    from typer.testing import CliRunner

    from specdp_cli.cli import app

    path = Path(shutil.copytree(fp8["llama"][0], tmp_path / "q"))
    cfg_json = json.loads((path / "config.json").read_text())
    cfg_json["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(cfg_json))
    cfg = dp_config(tmp_path, path, models["draft"], dp=1, dp_sync="auto", M=64)
    res = CliRunner().invoke(app, ["validate", "config", str(cfg), "--json"])
    assert res.exit_code == 1
    assert any(why in e for e in json.loads(res.stdout)["errors"]), res.stdout


# -- FP8 compute (W8A8 kernels) and `quantization: fp8` ------------------------------------------------------

def _exact_activations(M: int, K: int, seed: int) -> torch.Tensor:
    """Activations whose 128-column groups quantize without rounding: FP8-representable values times a power of
    two per group, each group holding +-448 (so its scale is that power of two exactly)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 60).to(torch.float8_e4m3fn).float()
    for c in range(0, K, 128):
        x[:, c] = 448.0 * torch.sign(torch.randn(M, generator=g)).clamp(min=0).mul(2).sub(1)
        x[:, c:c + 128] *= 2.0 ** torch.randint(-6, 6, (M, 1), generator=g).float()
    return x


def interpreted_kernel_checks() -> None:
    """fp8_kernels.py under Triton's interpreter (TRITON_INTERPRET=1, CPU; run in test_kernels_interpreted.py's
    interpreter process): the quantization's scales and values
    and the block-scaled GEMM (every tile path: decode, verification rows and prefill tiles; activations quantized
    inside or before or not at all, split K summed
    by the tile's last program or by a second kernel, per-row
    weight scales, partial blocks, bias) against float64 torch. Inputs quantize without rounding because the
    interpreter's float8 conversion rounds some values below a power of two down a binade (the GPU's does not:
    tests/test_gpu.py checks random inputs there)."""
    from specdp_cli.runtime import fp8_kernels as fk
    from specdp_cli.runtime.models.quant import dequantize, quantize_blocks

    x = _exact_activations(5, 300, 0)
    q, s = fk.quantize_activations(x)
    assert torch.equal(q.float() * s.repeat_interleave(128, 1)[:, :300], x)
    q2, s2 = fk.quantize_activations(x, column_major_scales=True)
    assert s2.stride() == (1, 5) and torch.equal(s2, s) and torch.equal(q2.float(), q.float())
    cases = [(5, 200, 300, 128, True, 1), (3, 64, 512, 1, False, 2), (20, 96, 256, 128, True, 4),
             (70, 160, 384, 128, False, 1), (80, 32, 256, 128, True, 2)]
    for i, (M, N, K, rows, bias, split) in enumerate(cases):
        fk.VERIFY_MAX_M = 64 if M == 70 else 127         # 70 rows on the prefill tile, 80 on verification rows
        g = torch.Generator().manual_seed(i)
        wq, ws = quantize_blocks(torch.randn(N, K, generator=g))
        if rows == 1:
            ws = ws.repeat_interleave(128, 0)[:N].contiguous() * torch.rand(N, 1, generator=g)
        x = _exact_activations(M, K, i)
        b = torch.randn(N, generator=g) if bias else None
        ref = x.double() @ dequantize(wq, ws, (rows, 128), torch.float64).t() + (b.double() if bias else 0)
        tile = {**fk.tiles(M, N, K, 132), "SPLIT": split}
        expected = (64, 2) if M == 80 else (64, 8) if M == 70 else (tile["BLOCK_M"], 1)
        assert (tile["BLOCK_M"], tile["GROUP_M"]) == expected, (M, tile)
        x_q, x_s = fk.quantize_activations(x)           # once a case: the interpreter runs a program a row
        for xs in (None, x_s):
            xin = x if xs is None else x_q
            ys = []
            for fk.SPLITK_TICKETS in (True, False):      # split K summed by the last program, or by a second kernel
                ys.append(fk.block_fp8_gemm(xin, wq, ws, rows, b, x_scale=xs, out_dtype=torch.float32, tile=tile))
                err = ((ys[-1].double() - ref).norm() / ref.norm()).item()
                assert err < 1e-6, (M, N, K, rows, split, xs is None, fk.SPLITK_TICKETS, err)
            fk.SPLITK_TICKETS = True
            assert torch.equal(ys[0], ys[1])
            if split > 1:                                # every tile's ticket counter is back at zero
                assert not fk._TICKETS[None].any()
            # the product computed transposed (weight tile on the tensor cores' wide side); the scales loaded one K
            # block ahead, plain and transposed
            swapped = {**tile, "SWAP": True, "BLOCK_M": max(16, min(128, 1 << (M - 1).bit_length())), "GROUP_M": 1}
            for t in (swapped, {**tile, "AHEAD": True}, {**swapped, "AHEAD": True}):
                y = fk.block_fp8_gemm(xin, wq, ws, rows, b, x_scale=xs, out_dtype=torch.float32, tile=t)
                err = ((y.double() - ref).norm() / ref.norm()).item()
                assert err < 1e-6, (t, M, N, K, rows, split, xs is None, err)
                if split > 1:
                    assert not fk._TICKETS[None].any()
        for t in (tile, {**tile, "SWAP": True}, {**tile, "AHEAD": True}):
            y = fk.block_fp8_gemm(x, wq, ws, rows, b, out_dtype=torch.float32, tile=t, mode="weight_only")
            assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6, ("weight_only", t)
    fk.VERIFY_MAX_M = 127
    print("interpreted fp8 kernels: ok")


def test_fp8_weights_join_and_reorder_exactly():
    """qkv / gate_up joins and the latent attention's row reorder keep each row's scales (block scales where
    the parts fill whole blocks, else one per row); dequantized they equal the same ops on dequantized weights."""
    from specdp_cli.runtime.models.quant import FP8Weight, cat_fp8, quantize_blocks

    g = torch.Generator().manual_seed(1)

    def fp8(n, k):
        q, s = quantize_blocks(torch.randn(n, k, generator=g))
        return FP8Weight(q, s, 128, torch.float32)

    a, b, c = fp8(256, 200), fp8(128, 200), fp8(100, 200)
    whole = cat_fp8([a, b, c])
    assert whole.rows == 128 and whole.scale.shape == (4, 2)
    assert torch.equal(whole.dequantize(), torch.cat([a.dequantize(), b.dequantize(), c.dequantize()]))
    ragged = cat_fp8([c, a])
    assert ragged.rows == 1 and torch.equal(ragged.dequantize(), torch.cat([c.dequantize(), a.dequantize()]))
    rows = torch.randperm(256, generator=g)
    assert torch.equal(a.take_rows(rows).dequantize(), a.dequantize()[rows])
    stacked = cat_fp8([a, a], stack=True)
    assert stacked.weight.shape == (2, 256, 200) and torch.equal(stacked.dequantize()[1], a.dequantize())
    # where the parts have cuBLAS's scale layout (loaded on a GPU that runs its block-scaled GEMM), the join has its
    # own: qkv and gate_up reach cuBLAS from CUBLAS_FROM_M rows as o and down do; a join with a scale a row has none
    from specdp_cli.runtime.fp8_kernels import cublas_weight_scale
    for p in (a, b, c):
        p.cublas_scale = cublas_weight_scale(p.scale)
    whole = cat_fp8([a, b, c])
    assert whole.cublas_scale.shape == (4, 4) and whole.cublas_scale.stride() == (1, 4)
    assert torch.equal(whole.cublas_scale, cublas_weight_scale(whole.scale))
    assert cat_fp8([c, a]).cublas_scale is None and cat_fp8([a, b, fp8(128, 200)]).cublas_scale is None


def test_quantization_fp8_on_cpu_equals_transformers_on_the_quantized_weights(tmp_path, models, fp8):
    """`quantization: fp8` on a float32 checkpoint: its linear layers quantized to 128 x 128 blocks at load and,
    on the CPU, dequantized again: greedy tokens equal transformers' on a copy quantized the same way (the
    published layout's rule), with a float32 draft model beside it; preflight says so."""
    import shutil

    path, ref = fp8["llama"]
    src = tmp_path / "llama"
    shutil.copytree(path.parent / "llama", src)
    cfg, plan = make_config(src, models["draft"], method="draft_model", k=3, M=64, max_num_seqs=4, max_batched=24,
                            quantization="fp8")
    q = plan.memory["quantization"]
    assert q["source"] == "on load" and q["loaded_as"] == "float32" and "lm_head.weight" in q["high_precision"]
    assert plan.memory["drafter_quantization"] is None
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=7)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(ref, done, prompts, 30, 64, "llama-quantized-at-load")
    assert engine.counters.spec.num_drafts > 0


def test_quantization_fp8_preflight(tmp_path, models, fp8, monkeypatch):
    """validate config: on the CPU `quantization: fp8` is reported as quantized then dequantized; the drafter's
    own setting (speculative.quantization) is reported for the drafter; a GPU without FP8 refuses
    `quantization: fp8` and dequantizes an FP8 checkpoint with a warning; a GPU with FP8 keeps it and counts
    one byte a quantized weight."""
    from specdp_cli import plan as plan_mod
    from specdp_cli.config import validate
    from specdp_cli.preflight import run_preflight

    src = fp8["llama"][0].parent / "llama"
    base = {"model": str(src), "max_model_len": 64, "device": "cpu", "dtype": "float32",
            "speculative": {"method": "draft_model", "model": str(models["draft"]), "num_speculative_tokens": 2,
                            "quantization": "fp8"}, "quantization": "fp8"}
    r = run_preflight(validate(base))
    assert r.ok, r.errors
    memory = {c.name: c.detail for c in r.checks}["memory"]
    assert "target's linear layers, quantized to FP8 (128x128 blocks) at load, are dequantized to float32" in memory
    assert "drafter's linear layers" in memory
    assert r.plan.memory["drafter_quantization"]["source"] == "on load"

    monkeypatch.setattr(plan_mod, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(plan_mod, "device_memory", lambda device: (80 << 30, 80 << 30))
    gpu = {**base, "device": "cuda", "dtype": "bfloat16", "speculative": {**base["speculative"], "quantization": None}}
    monkeypatch.setattr(plan_mod, "fp8_capability", lambda: (8, 0))
    r = run_preflight(validate(gpu))
    assert not r.ok and any("quantization: fp8 quantizes the target to FP8 at load, but this GPU (compute "
                            "capability 8.0) has no FP8" in e for e in r.errors), r.errors
    r = run_preflight(validate({**gpu, "model": str(fp8["llama"][0]), "quantization": None}))
    assert any("FP8 weights (128x128 blocks) are dequantized to bfloat16 at load: this GPU (compute capability 8.0)"
               in w for w in r.warnings), r.warnings + r.errors

    monkeypatch.setattr(plan_mod, "fp8_capability", lambda: (9, 0))
    r8 = run_preflight(validate(gpu))
    r16 = run_preflight(validate({**gpu, "quantization": None}))
    assert r8.to_json()["quantization"]["loaded_as"] == "float8_e4m3fn"
    assert "compute as W8A8" in {c.name: c.detail for c in r8.checks}["memory"]
    from specdp_cli.modeldir import ModelDir
    md = ModelDir.open(str(src), "model")
    # the quantized weights take 1 byte an element and a float32 scale per 128 x 128 block, the rest bfloat16's 2
    expected = sum(torch.Size(s).numel() + 4 * -(-s[0] // 128) * -(-s[1] // 128) if "_proj" in n
                   else 2 * torch.Size(s).numel() for n, (_, s) in md.tensor_headers.items())
    assert md.weight_bytes("bfloat16", fp8=True) == expected
    assert r8.plan.memory["weight_bytes"] - r16.plan.memory["weight_bytes"] == expected - md.weight_bytes("bfloat16")


def test_add_norm_wanted_decides_by_shapes_and_settings(monkeypatch):
    """Where o / down join the residual stream in their GEMM and hand the next FP8 linear its norm
    (fp8_kernels.add_norm_wanted): activations already quantized (not a norm's output already), 16-bit, on CUDA, 1-16
    rows, the GEMM's output columns a multiple of 128 and the next linear's input, that linear reading quantized input
    (fused_quant_wanted), FUSE_ADD_NORM on; never for a plain tensor or a plain weight (ops.add_norm_wanted)."""
    from specdp_cli.runtime import fp8_kernels as fk, ops
    from specdp_cli.runtime.models.quant import FP8Weight

    class Q:                                      # stands for CUDA float8 values: what the decision reads of them
        def __init__(self, M, cuda=True):
            self.shape, self.is_cuda, self.device = (M, 256), cuda, torch.device("cpu")

    def fp8(N, K):
        return FP8Weight(torch.zeros(N, K).to(torch.float8_e4m3fn), torch.ones(-(-N // 128), -(-K // 128)), 128,
                         torch.bfloat16)

    def act(M, dtype=torch.bfloat16, sumsq=None, cuda=True):
        return fk.FP8Activation(Q(M, cuda), None, dtype, sumsq)

    o, gate_up = fp8(512, 256), fp8(1024, 512)
    assert ops.add_norm_wanted(act(1), o, gate_up) and ops.add_norm_wanted(act(16), o, gate_up)
    assert ops.add_norm_wanted(act(5, torch.float16), o, gate_up)
    assert not ops.add_norm_wanted(act(17), o, gate_up)                          # verification rows
    assert not ops.add_norm_wanted(act(1, torch.float32), o, gate_up)
    assert not ops.add_norm_wanted(act(1, sumsq=torch.ones(1, 2)), o, gate_up)   # a norm's output already
    assert not ops.add_norm_wanted(act(1, cuda=False), o, gate_up)
    assert not ops.add_norm_wanted(act(1), o, None) and not ops.add_norm_wanted(act(1), o, fp8(1024, 384))
    assert not ops.add_norm_wanted(act(1), fp8(320, 256), fp8(1024, 320))        # columns not whole groups
    assert not ops.add_norm_wanted(act(1), o, torch.zeros(1024, 512))            # a plain next weight
    assert not ops.add_norm_wanted(torch.zeros(1, 256), o, gate_up)              # not quantized
    monkeypatch.setattr(fk, "FUSE_ADD_NORM", False)
    assert not ops.add_norm_wanted(act(1), o, gate_up)


def test_fused_quant_wanted_decides_by_shapes_and_settings(monkeypatch):
    """Where a norm / activation kernel hands an FP8 linear its output quantized (fp8_kernels.fused_quant_wanted):
    CUDA activations at decode rows (M <= 64) and verification rows (up to VERIFY_MAX_M, unless the weight is wide
    enough for cuBLAS's tiles to fill the device: fp8_kernels.verify_on_cublas) for a weight kept FP8 with K a
    multiple of 128, DECODE_MODE "quantize" and FUSE_DECODE_QUANT; never on CPU (ops.fused_quant_wanted), for a plain
    weight, more rows, other K, other decode modes, or with the switch off."""
    from specdp_cli.runtime import fp8_kernels as fk, ops
    from specdp_cli.runtime.models.quant import FP8Weight

    class Cuda:                                   # stands for a CUDA tensor: what the decision reads of it
        is_cuda = True

        device = torch.device("cpu")               # fp8_kernels._num_sms: 132 (an H200's) off CUDA

        def __init__(self, M, K, dtype=torch.bfloat16):
            self.shape, self.dtype = (M, K), dtype

        def dim(self):
            return 2

    def fp8(N, K):
        return FP8Weight(torch.zeros(N, K).to(torch.float8_e4m3fn), torch.ones(-(-N // 128), -(-K // 128)), 128,
                         torch.bfloat16)

    w = fp8(512, 256)
    assert fk.fused_quant_wanted(Cuda(1, 256), w) and fk.fused_quant_wanted(Cuda(64, 1024), w)
    assert fk.fused_quant_wanted(Cuda(5, 256, torch.float32), w)
    assert fk.fused_quant_wanted(Cuda(65, 256), w) and fk.fused_quant_wanted(Cuda(127, 256), w)   # verification rows
    assert not fk.fused_quant_wanted(Cuda(128, 256), w)                # cuBLAS's rows (CUBLAS_FROM_M)
    wide = fp8(132 * 128, 256)
    wide.cublas_scale = fk.cublas_weight_scale(wide.scale)            # 132 column tiles of 128: cuBLAS fills the device
    assert fk.verify_on_cublas(80, 132 * 128, wide.cublas_scale, Cuda.device)
    assert not fk.verify_on_cublas(80, 131 * 128, wide.cublas_scale, Cuda.device)
    assert not fk.verify_on_cublas(64, 132 * 128, wide.cublas_scale, Cuda.device)
    assert fk.fused_quant_wanted(Cuda(64, 256), wide) and not fk.fused_quant_wanted(Cuda(80, 256), wide)
    assert fk.fused_quant_wanted(Cuda(80, 256), fp8(132 * 128, 256))  # no cuBLAS scales: the Triton GEMM
    with monkeypatch.context() as m:
        m.setattr(fk, "VERIFY_MAX_M", 64)                              # verification rows on the prefill tile
        assert not fk.fused_quant_wanted(Cuda(65, 256), w)
    assert not fk.fused_quant_wanted(Cuda(0, 256), w)
    assert not fk.fused_quant_wanted(Cuda(1, 192), fp8(512, 192))      # K not whole groups
    assert not fk.fused_quant_wanted(Cuda(1, 256), torch.zeros(512, 256))          # not an FP8 weight
    assert not fk.fused_quant_wanted(Cuda(1, 256), FP8Weight(torch.zeros(512, 256), w.scale, 128, torch.bfloat16))
    assert not ops.fused_quant_wanted(torch.zeros(1, 256), w)           # CPU: FP8 weights dequantized at load
    assert not ops.fused_quant_wanted(torch.zeros(1, 256), None)
    for name, value in (("DECODE_MODE", "gemv"), ("DECODE_MODE", "fused"), ("FUSE_DECODE_QUANT", False),
                        ("CUBLAS_FROM_M", 1)):
        with monkeypatch.context() as m:
            m.setattr(fk, name, value)
            assert not fk.fused_quant_wanted(Cuda(1, 256), w), (name, value)


def test_decode_tiles_of_the_8b_projections(monkeypatch):
    """fp8_kernels.tiles on an H200 (132 SMs) for the 8B's projections, as session 29's sweep and end-to-end rows chose
    them: up to 16 rows 64-wide column blocks for all four (gate_up too) and K split 4 (qkv, o) or 8 (down, 112 K
    blocks), gate_up unsplit; verification rows (80) keep 64-row blocks with their own split (gate_up's run on cuBLAS
    where it has cuBLAS's scales, else on the prefill tile); DECODE_TILES_29 off gives session 28's tiles (gate_up 32
    wide, down split 4). Up to 16 rows the product is computed transposed (SWAP_TILES "decode", session 36), on the
    same blocks and splits; at 80 rows it is not."""
    from specdp_cli.runtime import fp8_kernels as fk

    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}

    def chosen(M, swap=False):
        tiles = {name: fk.tiles(M, N, K, 132) for name, (N, K) in shapes.items()}
        assert all(t.get("SWAP", False) == swap for t in tiles.values()), (M, tiles)
        return {name: (t["BLOCK_M"], t["BLOCK_N"], t["SPLIT"]) for name, t in tiles.items()}

    assert fk.SWAP_TILES == "decode"
    for M in (1, 16):
        assert chosen(M, swap=True) == {"qkv": (16, 64, 4), "o": (16, 64, 4), "gate_up": (16, 64, 1),
                                        "down": (16, 64, 8)}, M
    assert chosen(80) == {"qkv": (64, 64, 2), "o": (64, 64, 2), "gate_up": (64, 128, 1), "down": (64, 64, 2)}
    monkeypatch.setattr(fk, "SWAP_TILES", "off")
    for M in (1, 16):
        assert chosen(M) == {"qkv": (16, 64, 4), "o": (16, 64, 4), "gate_up": (16, 64, 1), "down": (16, 64, 8)}, M
    monkeypatch.setattr(fk, "DECODE_TILES_29", False)
    assert chosen(16) == {"qkv": (16, 64, 4), "o": (16, 64, 4), "gate_up": (16, 32, 1), "down": (16, 64, 4)}
