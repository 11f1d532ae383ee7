"""Running `specdp generate` as a real command (accelerate-launched gloo ranks) with a hard timeout."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
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


def run_cli(*args, env=None, timeout=HARD_TIMEOUT_S, base_env=None) -> tuple[subprocess.CompletedProcess, float]:
    """`specdp ARGS` in a process of its own, killed after `timeout` (subprocess.TimeoutExpired), with this
    process's environment (or `base_env`) and `env`: (the result, seconds). The process is forked from a helper
    that has imported the command already (cli_forks.py): it skips the seconds of imports, not the command."""
    from cli_forks import FORKS

    full = dict(os.environ if base_env is None else base_env)
    full.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    full.update(env or {})
    argv = [str(a) for a in args]
    t0 = time.monotonic()
    code, out, err = FORKS.run(argv, full, os.getcwd(), timeout)
    r = subprocess.CompletedProcess([sys.executable, "-m", "specdp_cli", *argv], code, out, err)
    return r, time.monotonic() - t0


class Launches:
    """Commands started ahead of the tests that read their results, at most `workers` at a time, each `run_cli` with
    its hard timeout. A launch is nearly all process start-up (interpreters importing torch): on 2 cores one
    launch's single-process phases (the CLI, the launcher), another's, and the test's own in-process reference
    overlap. `start(key, fn, *args)` runs any function of launches (`fn` defaults to `run_cli`); an `exclusive`
    one runs alone, for a test that bounds the command's wall time (a fault caught in seconds)."""

    def __init__(self, workers: int = 2):
        self._pool = ThreadPoolExecutor(workers)
        self._runs: dict[object, Future] = {}
        self._turn = threading.Condition()
        self._running = 0
        self._alone = 0                # exclusive launches waiting or running: no other starts meanwhile

    def start(self, key, *args, env=None, timeout=HARD_TIMEOUT_S, fn=None, exclusive=False) -> None:
        """The environment is this process's now: a test that sets variables later (monkeypatch) does not reach it."""
        assert key not in self._runs, key
        if fn is None:
            fn, args = functools.partial(run_cli, env=env, timeout=timeout, base_env=dict(os.environ)), args
        self._runs[key] = self._pool.submit(self._run, exclusive, fn, *args)

    def _run(self, exclusive: bool, fn, *args):
        with self._turn:
            if exclusive:
                self._alone += 1
                self._turn.wait_for(lambda: self._running == 0)
            else:
                self._turn.wait_for(lambda: self._alone == 0)
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._turn:
                self._running -= 1
                self._alone -= exclusive
                self._turn.notify_all()

    def result(self, key):
        """What the launch returned (`run_cli`: (CompletedProcess, seconds)); its exception, re-raised."""
        return self._runs[key].result()

    def close(self) -> None:
        """Drop the launches not started, wait for the running ones (each within its hard timeout)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def selected(request, name: str) -> list[dict]:
    """The parameters of each of this module's tests named `name` that this session runs ({} for a test without
    parameters): a fixture starting launches ahead starts none for a test that is deselected."""
    return [dict(item.callspec.params) if hasattr(item, "callspec") else {} for item in request.session.items
            if getattr(item, "module", None) is request.module and getattr(item, "originalname", None) == name]


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


def generate_args(tmp: Path, inp: Path, cfg: Path) -> tuple:
    """`run_cli`'s arguments for `generate` of `cfg` over `inp`: output tmp / "out.jsonl", summary tmp / "s.json"."""
    return "generate", cfg, "--input", inp, "--output", tmp / "out.jsonl", "--summary-json", tmp / "s.json"


def lockstep_run_equals_dp1(tmp: Path, inp: Path, cfg: Path, ref: Path | None = None, launched=None) -> list[dict]:
    """Run `ref` (default: `cfg`) in this process at dp 1 and `cfg` as the real command; assert the same
    tokens; return the command's per-rank reports. The reference's output is tmp / "ref.jsonl". `launched`:
    the command's result when it was started ahead (`Launches.result`, called once the reference is done)."""
    run_in_process(ref or cfg, inp, tmp / "ref.jsonl")
    r, _ = launched() if launched is not None else run_cli(*generate_args(tmp, inp, cfg))
    assert r.returncode == 0, r.stdout + r.stderr
    assert same_tokens(read_out(tmp / "ref.jsonl"), read_out(tmp / "out.jsonl")) == []
    return json.load(open(tmp / "s.json"))["ranks"]


def expert_parallel_job(tmp: Path, models, target, dp: int, method: str) -> tuple[Path, Path, Path]:
    """(input, dp 1 reference config, config) of a job with the routed experts of the MoE `target` split over `dp`
    lockstep ranks (collectives checked): its tokens must be those of one rank holding every expert."""
    inp = write_jsonl(tmp / "in.jsonl", text_rows(models["tokenizer"], [20, 4, 9, 13, 6], [20, 3, 12, 7, 15], seed=25))
    ref = dp_config(tmp, target, models["draft"], dp=1, dp_sync="auto", method=method, k=3, M=64, name="ref.yaml")
    cfg = dp_config(tmp, target, models["draft"], dp=dp, dp_sync="auto", method=method, k=3, M=64, check=True,
                    parallel={"enable_expert_parallel": True})
    return inp, ref, cfg
