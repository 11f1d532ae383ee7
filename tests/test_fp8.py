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
