"""Job results on disk: per-rank part files (resumable), the merged output, and the summary.

Each rank appends every finished result to `OUTPUT.rank{r}.part` as one whole JSON line. A rerun
of the same command reads `OUTPUT` and the part files beside it and serves only what is missing
(error records count as done unless retried); a torn last line is ignored. The merged `OUTPUT` is
written in input order by rank 0 and replaces the part files.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any

from ..launch import LAUNCH_PHASES
from ..runtime.scheduler import Sequence, SpecStats
from .inputs import JobRequest, id_key

STARTUP_PHASES = ("launch_s", "load_s", "kv_alloc_s", "capture_s")


def part_path(output: str, rank: int) -> str:
    return f"{output}.rank{rank}.part"


def part_files(output: str) -> list[str]:
    return sorted(glob.glob(glob.escape(output) + ".rank*.part"))


class PartWriter:
    def __init__(self, path: str):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        # one write() of one whole line: a crash leaves at most a torn last line, never a mixed one
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def read_records(path: str) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue            # a torn line (the job died while writing it)
                if isinstance(rec, dict) and "id" in rec:
                    out.append(rec)
    except OSError:
        pass
    return out


def load_prior(output: str, retry_errors: bool) -> dict[str, dict]:
    """Results of earlier runs on this machine: OUTPUT and its part files, by id key."""
    prior: dict[str, dict] = {}
    for path in [output] + part_files(output):
        for rec in read_records(path):
            if retry_errors and "error" in rec:
                continue
            prior.setdefault(id_key(rec["id"]), rec)
    return prior


def success_record(seq: Sequence, text: str) -> dict:
    """A finished sequence's output line (a sequence the engine failed: its error line)."""
    s = seq.stats
    if seq.finish_reason == "error":
        return {"id": seq.req.id, "error": seq.error or "the engine failed this request"}
    rec = {
        "id": seq.req.id,
        "text": text,
        "token_ids": seq.generated,
        "finish_reason": "stop" if seq.finish_reason == "stop" else "length",
        "prompt_tokens": seq.num_prompt,
        "completion_tokens": len(seq.generated),
        "spec": {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                 "num_accepted_tokens": s.num_accepted_tokens},
    }
    if seq.logprobs is not None:        # per generated token: its log-probability and the top alternatives
        rec["logprobs"] = [{"logprob": lp, "top_logprobs": [[t, v] for t, v in top]} for lp, top in seq.logprobs]
    return rec


def error_record(req: JobRequest) -> dict:
    return {"id": req.id, "error": req.error, "fingerprint": req.fingerprint}


def write_output(output: str, requests: list[JobRequest], records: dict[str, dict]) -> int:
    """Write OUTPUT in input order, atomically; returns how many lines were written."""
    tmp = output + ".tmp"
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for req in requests:
            rec = records.get(req.key)
            if rec is not None:
                fh.write(json.dumps(rec) + "\n")
                n += 1
    os.replace(tmp, output)
    return n


def job_file(output: str) -> str:
    """Beside the output: the fingerprint parts of the job that wrote it (to say what changed)."""
    return output + ".job.json"


def remove_parts(output: str) -> None:
    for p in part_files(output):
        try:
            os.remove(p)
        except OSError:
            pass


def summarize(rank_reports: list[dict], new_records: list[dict], wall_s: float | None, resumed: int = 0,
              weights_per_token: dict | None = None) -> dict[str, Any]:
    """The summary of one run from every rank's report (see `rank_report`); `resumed`: inputs whose
    results came from earlier runs of the same job."""
    stats = SpecStats()
    for rep in rank_reports:
        stats.merge(SpecStats(**rep["spec"]))
    starts = [r["first_step_t"] for r in rank_reports if r["first_step_t"] is not None]
    ends = [r["last_step_t"] for r in rank_reports if r["last_step_t"] is not None]
    engine_s = (max(ends) - min(starts)) if starts and ends else 0.0
    generated = sum(r["generated_tokens"] for r in rank_reports)
    errors = sum(1 for r in new_records if "error" in r)
    nd = stats.num_drafts
    startup = {k: max(r["startup"][k] for r in rank_reports) for k in STARTUP_PHASES} if rank_reports else {}
    launch = {k: max(r["launch"].get(k, 0.0) for r in rank_reports) for k in LAUNCH_PHASES} if rank_reports else {}
    return {
        "speculation": speculation_summary(rank_reports),
        "requests": len(new_records),
        "resumed": resumed,
        "errors": errors,
        "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in new_records if "error" not in r),
        "generated_tokens": generated,
        "wall_s": wall_s,
        "engine_s": engine_s,
        "tok_s": generated / engine_s if engine_s > 0 else None,
        "num_drafts": nd,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "acceptance_rate": stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else None,
        "mean_acceptance_length": 1 + stats.num_accepted_tokens / nd if nd else None,
        "accepted_per_position": [a / nd for a in stats.accepted_per_pos] if nd else [],
        "preemptions": sum(r["preemptions"] for r in rank_reports),
        "prefix_cache": prefix_cache_summary(rank_reports),
        "weights_per_token": weights_per_token,
        "startup": startup,
        "launch_phases": launch,
        "ranks": [{**{k: r.get(k) for k in ("rank", "requests", "steps", "padding_steps", "skipped_drafter_steps",
                                            "generated_tokens", "preemptions", "planned_ahead", "chunk_steps",
                                            "weight_bytes", "expert_weight_bytes", "graphs", "gc_collections", "gc_pause_s",
                                            "prefix_cache")},
                   **rank_times(r, min(starts) if starts else None)} for r in rank_reports],
    }


def prefix_cache_summary(rank_reports: list[dict]) -> dict | None:
    """Prompt tokens looked up in the ranks' prefix caches and found there (vLLM's queries and hits)."""
    reps = [r["prefix_cache"] for r in rank_reports if r.get("prefix_cache")]
    if not reps:
        return None
    q, h = sum(r["queries"] for r in reps), sum(r["hits"] for r in reps)
    return {"queries": q, "hits": h, "hit_rate": h / q if q else None}


def rank_times(report: dict, first_start: float | None) -> dict:
    """A rank's own engine time and when its first step began after the first rank's (seconds): where
    a DP run's engine time goes when one rank starts late or ends last."""
    a, b = report.get("first_step_t"), report.get("last_step_t")
    if a is None or b is None or first_start is None:
        return {"engine_s": 0.0, "start_offset_s": None}
    return {"engine_s": b - a, "start_offset_s": a - first_start}


def speculation_summary(rank_reports: list[dict]) -> dict | None:
    """The step k actually used (steps per k, summed over the ranks: in lockstep every rank counts the
    same steps) and rank 0's adaptive model (per k: expected tokens per row and step, step cost)."""
    reps = [r["spec_length"] for r in rank_reports if r.get("spec_length")]
    if not reps:
        return None
    steps: dict[str, int] = {}
    for rep in reps:
        for k, n in rep["steps_by_k"].items():
            steps[k] = steps.get(k, 0) + n
    first = reps[0]
    return {"mode": first["mode"], "k_values": first["k_values"],
            "steps_by_k": dict(sorted(steps.items(), key=lambda kv: int(kv[0]))),
            "model_acceptance_per_position": first["model_acceptance_per_position"],
            "model_rows": first["model_rows"], "model": first["model"],
            "model_chunk_share": first.get("model_chunk_share"), "model_chunk_extra_ms": first.get("model_chunk_extra_ms"),
            "model_level": first.get("model_level"),
            **({"trace": first["trace"]} if "trace" in first else {})}
