"""`specdp generate` as the CLI process runs it: read the inputs, run the ranks (in this process for
one rank, through accelerate for several), show progress, print and write the summary."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..config import Config
from ..launch import Ranks, Terminated, launch_phases, process_start_time, threads_per_rank
from ..modeldir import load_tokenizer
from ..plan import Plan, world_size
from ..prompts import PromptEncoder
from ..runtime.faults import FaultSpecError, Faults
from . import JobFailed
from .fingerprint import changed_parts, job_hash, job_parts
from .inputs import InputError, JobRequest, id_key, read_inputs
from .results import job_file, load_prior, part_files


class PartFollower:
    """Counts finished results by reading the part files' new whole lines as they grow (results done before this
    run — `known`, resumed from earlier part files — count as done but add no tokens: the rate is this run's)."""

    def __init__(self, output: str, known: set[str]):
        self.output = output
        self.done = set(known)
        self.tokens = 0                 # completion tokens of the results seen
        self.offsets: dict[str, int] = {}

    def poll(self) -> int:
        for path in part_files(self.output):
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets.get(path, 0))
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self.offsets[path] = self.offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                try:
                    rec = json.loads(line)
                    key = id_key(rec["id"])
                    if key not in self.done:
                        self.done.add(key)
                        self.tokens += int(rec.get("completion_tokens") or 0)
                except (ValueError, KeyError, TypeError):
                    pass
        return len(self.done)


class ProgressLines:
    """Progress for a stderr that is not a terminal (a log file, CI, nohup), where the bar shows
    nothing until the end: one line every `every` seconds, from a thread of its own."""

    def __init__(self, console: Console, total: int | None, done: int, every: float = 10.0):
        self.console, self.total, self.done, self.every = console, total, done, every
        self.tokens = 0
        self.t0 = time.monotonic()
        self._start_done = done
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="specdp-progress")

    def __enter__(self) -> "ProgressLines":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.console.print(self.line(), markup=False, highlight=False)

    def line(self) -> str:
        secs = time.monotonic() - self.t0
        new = self.done - self._start_done
        parts = [f"generate: {self.done}/{self.total if self.total is not None else '?'} done",
                 f"{self.tokens / secs:,.0f} tok/s" if secs > 0 else "", f"{_clock(secs)} elapsed"]
        if self.total and new > 0:
            parts.append(f"eta {_clock(secs / new * (self.total - self.done))}")
        return ", ".join(p for p in parts if p)


def _clock(secs: float) -> str:
    secs = int(secs)
    return f"{secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}"


def make_progress(console: Console) -> Progress:
    """The bar on a terminal; elsewhere (a log file, CI) none at all — `ProgressLines` reports there instead."""
    return Progress(TextColumn("[bold]generate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False,
                    disable=not console.is_terminal)


def run_generate(cfg: Config, plan: Plan, input_path: str | None, output: str, retry_errors: bool,
                 err: Console, ranks: Ranks | None = None, overwrite: bool = False) -> dict | None:
    """Run the job, in this process for one rank, else in `ranks` (started, waiting for the job);
    returns the summary (on machine 0), raises JobFailed with a sentence."""
    world = world_size(cfg.parallel)         # processes: dp x tp
    try:
        faults = Faults.from_env(cfg.parallel.data_parallel_size, cfg.parallel.tensor_parallel_size)
    except FaultSpecError as e:
        raise JobFailed(str(e)) from None
    leader = cfg.parallel.machine_rank == 0
    requests: list[JobRequest] = []
    if leader:
        if not input_path:
            raise JobFailed("--input is required on machine 0")
        encoder = PromptEncoder(load_tokenizer(cfg.tokenizer_path), cfg.chat_template)
        try:
            requests = read_inputs(input_path, cfg, encoder)
        except InputError as e:
            raise JobFailed(str(e)) from None
    parts = job_parts(cfg, plan)
    job = job_hash(parts)
    for r in requests:
        r.fingerprint["job"] = job
    if overwrite:
        for path in [output, job_file(output)] + part_files(output):
            if os.path.exists(path):
                os.remove(path)
    prior = load_prior(output, retry_errors)
    if leader:
        check_resumable(output, requests, prior, parts)
        with open(job_file(output), "w") as fh:
            json.dump(parts, fh, indent=1)
    keys = {r.key for r in requests}
    already = {k for k in prior if k in keys}
    if already:
        err.print(f"resuming: {len(already)} of {len(requests)} inputs are already done in {output} or its part files")

    lines = ProgressLines(err, len(requests) if leader else None, len(already)) if not err.is_terminal else None
    with make_progress(err) as progress, (lines or contextlib.nullcontext()):
        task = progress.add_task("generate", total=len(requests) if leader else None, completed=len(already))
        if world == 1:
            def on_result(rec: dict) -> None:
                progress.advance(task)
                if lines:
                    lines.done += 1
                    lines.tokens += int(rec.get("completion_tokens") or 0)

            return _in_process(cfg, plan, faults, output, retry_errors, requests, on_result, progress.console)
        follower = PartFollower(output, already)

        def tick() -> None:
            for line in ranks.ready_lines():          # each rank's start-up line, once (they log to a file)
                progress.console.print(line, markup=False, highlight=False)
            follower.poll()
            done = len(follower.done & keys) if leader else len(follower.done)
            progress.update(task, completed=done)
            if lines:
                lines.done, lines.tokens = done, follower.tokens

        summary = _launched(cfg, plan, output, retry_errors, requests, tick, ranks)
        if leader:
            progress.update(task, completed=len(requests))   # the part files are merged away by now
        return summary


def check_resumable(output: str, requests: list[JobRequest], prior: dict[str, dict], parts: dict[str, str]) -> None:
    """Earlier results are reused only when this job would make them again: refuse, before any work,
    with what changed (a part of the job, or an input line) and how to go on."""
    how = "rerun with --overwrite to start afresh, or choose another --output"
    job = job_hash(parts)
    for r in requests:
        rec = prior.get(r.key)
        if rec is None:
            continue
        fp = rec.get("fingerprint")
        if not isinstance(fp, dict):
            raise JobFailed(f"{output} holds results without a job fingerprint (written by an older specdp), so "
                            f"they may come from another job: {how}")
        if fp.get("job") != job:
            try:
                with open(job_file(output)) as fh:
                    old = json.load(fh)
            except (OSError, ValueError):
                old = None
            if not isinstance(old, dict) or job_hash(old) != fp.get("job"):
                old = None                  # no description of the job that made them
            raise JobFailed(f"{output} holds results of another job: {changed_parts(old, parts)} changed since "
                            f"they were made; {how}")
        if fp.get("input") != r.fingerprint["input"]:
            raise JobFailed(f"line {r.line} (id {r.id!r}) changed since its result in {output} was made (its "
                            f"prompt or sampling fields); {how}")


def _in_process(cfg, plan, faults, output, retry_errors, requests, on_result, console: Console) -> dict:
    started_ranks_at = time.time()
    from ..runtime.build import build_engine, rank_device
    from ..runtime.dist import DPGroup
    from ..runtime.heap import thaw_heap
    from ..runtime.progress import NoProgressError
    from .generate import run_rank

    class FaultExit(Exception):
        pass

    def fault_exit(code: int, message: str) -> None:
        raise FaultExit(f"rank 0 exited with status {code} during step {engine.step_no} ({message})")

    device = rank_device(plan, 0, threads_per_rank(plan.device, plan.ranks_per_machine))
    t0 = process_start_time()
    now = time.time()
    launch = launch_phases(t0, started_ranks_at, started_ranks_at, now, now, now)
    engine = build_engine(cfg, plan, DPGroup.solo(), device, faults, on_fault_exit=fault_exit, started_at=t0,
                          launch=launch)
    console.print(engine.ready_line, markup=False, highlight=False)
    try:
        return run_rank(engine, engine.dp, output, retry_errors, requests, True, on_result)
    except FaultExit as e:
        raise JobFailed(f"{e}; finished results are kept in {output}.rank0.part — rerun to resume") from None
    except NoProgressError as e:
        raise JobFailed(f"{e}\nfinished results are kept in {output}.rank0.part (a rerun resumes from them)") from None
    finally:
        thaw_heap()          # this process may go on (a caller's, a test's): the job's objects can be collected again


def _launched(cfg, plan, output, retry_errors, requests, on_tick, ranks: Ranks) -> dict | None:
    run_dir = ranks.run_dir
    if cfg.parallel.machine_rank == 0:
        run_dir.write_payload(requests)
    run_dir.write_job(cfg, plan, "generate", ranks.started_at, output=output, retry_errors=retry_errors)
    rc = ranks.wait(on_tick)
    on_tick()
    if rc in (130, 143):         # the ranks were ended: their run directory (logs of a run stopped on purpose) goes
        run_dir.cleanup()
        raise Terminated() if rc == 143 else KeyboardInterrupt()
    if rc != 0:
        msg = ranks.failure_message()
        tail = ranks.log_tail() if "did not start" in msg or "launcher failed" in msg else ""
        raise JobFailed(msg + (f"\n--- last lines of {ranks.log_path} ---\n{tail}" if tail else "")
                        + f"\nfinished results are kept in the part files beside {output}; rerun the same command "
                          f"to resume (logs: {run_dir.path})")
    summary = None
    path = run_dir.file("summary.json")
    if os.path.isfile(path):
        with open(path) as fh:
            summary = json.load(fh)
    run_dir.cleanup()
    return summary



def _hits(pc: dict | None) -> str:
    """Prompt tokens found in the prefix cache, of those looked up."""
    if not pc:
        return "- (prefix caching off)"
    rate = f" ({pc['hit_rate']:.1%})" if pc["hit_rate"] is not None else ""
    return f"{pc['hits']} of {pc['queries']} prompt tokens{rate}"

def print_summary(summary: dict, console: Console) -> None:
    t = Table(title="specdp generate", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")

    def f(v, fmt="{:.3f}"):
        return "-" if v is None else (fmt.format(v) if isinstance(v, float) else str(v))

    rows = [("requests", summary["requests"]), ("resumed (done earlier)", summary["resumed"]),
            ("errors", summary["errors"]),
            ("prompt tokens", summary["prompt_tokens"]), ("generated tokens", summary["generated_tokens"]),
            ("wall time (s)", f(summary["wall_s"], "{:.2f}")), ("engine time (s)", f(summary["engine_s"], "{:.2f}")),
            ("tokens / s", f(summary["tok_s"], "{:.1f}")), ("drafts", summary["num_drafts"]),
            ("draft tokens", summary["num_draft_tokens"]), ("accepted tokens", summary["num_accepted_tokens"]),
            ("acceptance rate", f(summary["acceptance_rate"])),
            ("mean acceptance length", f(summary["mean_acceptance_length"])),
            ("accepted per position", ", ".join(f"{a:.2f}" for a in summary["accepted_per_position"]) or "-"),
            ("preemptions", summary["preemptions"]),
            ("prefix cache hits", _hits(summary.get("prefix_cache"))),
            ("start-up (s)", ", ".join(f"{k[:-2]} {v:.2f}" for k, v in summary["startup"].items()) or "-")]
    read = summary.get("weights_per_token")
    if read:
        rows.insert(-1, ("weights read per token", f"{read['active_bytes'] / 2**30:.3f} GiB active of "
                                                    f"{read['total_bytes'] / 2**30:.3f} GiB"
                                                    + (f" ({read['routed']})" if read["routed"] else "")))
    spec = summary.get("speculation")
    if spec:
        rows.insert(-2, ("speculation length", f"{spec['mode']} (k in {', '.join(map(str, spec['k_values']))})"))
        rows.insert(-2, ("steps by k", ", ".join(f"k {k}: {n}" for k, n in spec["steps_by_k"].items()) or "-"))
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)
    if spec and spec.get("model"):
        extra = spec.get("model_chunk_extra_ms")
        mt = Table(title=f"adaptive k: the model (rank 0, {spec['model_rows']} padded rows"
                         + (f"; prompt chunks add {extra:.3f} ms to a step" if extra is not None else "") + ")")
        for col in ("k", "expected tokens / row / step", "step cost (ms)", "tokens / s / row",
                    "measured decode step (ms)"):
            mt.add_column(col, justify="right")

        def ms(v):
            return "-" if v is None else f"{v:.3f}"
        for m in spec["model"]:
            mt.add_row(str(m["k"]), f"{m['tokens_per_step']:.2f}", f"{m['step_ms']:.3f}", f"{m['tokens_per_s_per_row']:.1f}",
                       ms(m.get("measured_decode_ms")))
        console.print(mt)
    if len(summary["ranks"]) > 1 or summary["ranks"][0]["padding_steps"]:
        rt = Table(title="ranks")
        cols = ("rank", "requests", "steps", "padding_steps", "skipped_drafter_steps", "generated_tokens", "preemptions")
        for col in cols:
            rt.add_column(col.replace("_", " "), justify="right")
        for r in summary["ranks"]:
            rt.add_row(*(str(r[c]) for c in cols))
        console.print(rt)
