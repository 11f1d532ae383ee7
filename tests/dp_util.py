"""Running `specdp generate` as a real command (accelerate-launched gloo ranks) with a hard timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from helpers import write_config

HARD_TIMEOUT_S = 150


def dp_config(tmp: Path, target, draft, dp=2, dp_sync="always", k=3, M=64, D=None, name="c.yaml",
              timeout_s=20, check=False, method="draft_model", max_num_seqs=4, **extra) -> Path:
    data = {"model": str(target), "max_model_len": M, "device": "cpu", "dtype": "float32",
            "speculative": {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 1,
                            "prompt_lookup_max": 3, **({"model": str(draft)} if draft is not None else {})},
            "parallel": {"data_parallel_size": dp, "dp_sync": dp_sync, "collective_timeout_s": timeout_s,
                         "check_collectives": check},
            "scheduler": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 128},
            "sampling": {"max_tokens": 16}}
    if D is not None:
        data["speculative"]["max_model_len"] = D
    for key, v in extra.items():
        data[key] = {**data.get(key, {}), **v} if isinstance(v, dict) else v
    return write_config(tmp / name, data)


def run_cli(*args, env=None, timeout=HARD_TIMEOUT_S) -> tuple[subprocess.CompletedProcess, float]:
    full = dict(os.environ)
    full.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    full.update(env or {})
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "specdp_cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env=full)
    return r, time.monotonic() - t0


def run_in_process(cfg: Path, inp: Path, out: Path, *extra) -> None:
    """dp = 1, the reference: the same command in this process."""
    from specdp_cli.cli import app

    res = CliRunner().invoke(app, ["generate", str(cfg), "--input", str(inp), "--output", str(out), "--dp", "1", *extra])
    assert res.exit_code == 0, res.output


def read_out(path: Path) -> dict:
    return {json.dumps(r["id"]): r for r in map(json.loads, open(path))}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return path


def same_tokens(a: dict, b: dict) -> list[str]:
    """Ids whose results differ (token ids or finish reason)."""
    bad = [k for k in a if k not in b or a[k].get("token_ids") != b[k].get("token_ids")
           or a[k].get("finish_reason") != b[k].get("finish_reason")]
    return bad + [k for k in b if k not in a]


def text_rows(tokenizer_dir, lengths: list[int], max_tokens: list[int], seed: int) -> list[dict]:
    """JSONL input rows with text prompts (random ids decoded: the CLI takes text)."""
    from transformers import AutoTokenizer

    from engine_util import prompts_of_lengths

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return [{"id": f"r{i}", "prompt": tok.decode(p), "max_tokens": mt}
            for i, (p, mt) in enumerate(zip(prompts_of_lengths(lengths, seed=seed), max_tokens))]


def lockstep_run_equals_dp1(tmp: Path, inp: Path, cfg: Path, ref: Path | None = None) -> list[dict]:
    """Run `ref` (default: `cfg`) in this process at dp 1 and `cfg` as the real command; assert the same
    tokens; return the command's per-rank reports. The reference's output is tmp / "ref.jsonl"."""
    run_in_process(ref or cfg, inp, tmp / "ref.jsonl")
    r, _ = run_cli("generate", cfg, "--input", inp, "--output", tmp / "out.jsonl", "--summary-json", tmp / "s.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert same_tokens(read_out(tmp / "ref.jsonl"), read_out(tmp / "out.jsonl")) == []
    return json.load(open(tmp / "s.json"))["ranks"]


def expert_parallel_equals_dp1(tmp: Path, models, target, dp: int, method: str) -> list[dict]:
    """A MoE `target` with its routed experts split over `dp` lockstep ranks (collectives checked) gives
    the tokens of one rank holding every expert; returns the command's per-rank reports."""
    inp = write_jsonl(tmp / "in.jsonl", text_rows(models["tokenizer"], [20, 4, 9, 13, 6], [20, 3, 12, 7, 15], seed=25))
    ref = dp_config(tmp, target, models["draft"], dp=1, dp_sync="auto", method=method, k=3, M=64, name="ref.yaml")
    cfg = dp_config(tmp, target, models["draft"], dp=dp, dp_sync="auto", method=method, k=3, M=64, check=True,
                    parallel={"enable_expert_parallel": True})
    return lockstep_run_equals_dp1(tmp, inp, cfg, ref)
