"""A step's package: what a TP group's leader sends its followers before each step's device work, so that
every process of the group runs the same device work (`Engine._run_device_step`) over identical inputs.

Every decision is the leader's (DESIGN.md, "Tensor-parallel groups"): it schedules, syncs with the other DP
ranks, agrees the step's sizes and keeps the books; a follower holds no sequence and decides nothing. The
package carries the decisions and the inputs they produced:
  header (one MAX all-reduce, checked for being the same package on every process): the step, its agreed
      StepSizes, whether the drafter phase runs, the log-probabilities' width, the sampling kind, the size of a
      logits adjustment, or `stop` (the job is over: the followers' loop ends);
  body (one broadcast): the staged host rows and block table (first R_pad rows, `StepInputs.staged`) and, unless
      every row is greedy, the per-row sampling values (`sampling.row_values`);
  a logits adjustment (`logits_process.LogitsAdjust`, pickled), only in a step where some row asks for one.
The drafts that feed the target's forward are computed on every process from these identical inputs by the
replicated draft model (or staged on the host: n-gram), so they are identical too.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch

from .step_inputs import StepInputs
from .step_types import StepSizes

FIELDS = ("stop", "step", "R_pad", "K", "T_dec", "T", "T1", "k", "drafter_runs", "logprobs", "sampling", "adjust")
GREEDY, SAMPLED, FILTERED = 0, 1, 2          # the sampling field: every row greedy / some sample / some filter too


@dataclass
class StepPackage:
    step: int
    sizes: StepSizes
    drafter_runs: bool
    logprobs: int                          # alternatives a token reports (-1: no log-probabilities)
    sampling: tuple[dict, tuple | None]    # sampling.row_values of the R_pad rows
    adjust: object = None                  # logits_process.LogitsAdjust or None

    def decision(self) -> tuple:
        """What every process of the group must apply alike (check_collectives compares it)."""
        sz = self.sizes
        return (f"R_pad={sz.R_pad}", f"K={sz.K}", f"T_dec={sz.T_dec}", f"T={sz.T}", f"T1={sz.T1}", f"k={sz.k}",
                f"drafter_runs={int(self.drafter_runs)}", f"logprobs={self.logprobs}",
                f"sampling={_kind(self.sampling)}", f"adjust={int(self.adjust is not None)}")


def _kind(sampling: tuple[dict, tuple | None]) -> int:
    flags, values = sampling
    return GREEDY if values is None else FILTERED if flags["filter"] else SAMPLED


def send(tp, pkg: StepPackage, inputs: StepInputs) -> None:
    """The leader's side (its inputs already staged)."""
    sz = pkg.sizes
    blob = pickle.dumps(pkg.adjust.to("cpu")) if pkg.adjust is not None else b""
    values = pkg.sampling[1]
    tp.share_header([0, pkg.step, sz.R_pad, sz.K, sz.T_dec, sz.T, sz.T1, sz.k, int(pkg.drafter_runs),
                     pkg.logprobs + 1, _kind(pkg.sampling), len(blob)], len(FIELDS), pkg.step)
    parts = [inputs.staged(sz.R_pad)] + ([values[0], values[1].view(torch.long)] if values is not None else [])
    tp.share_tensor(torch.cat(parts, 1), pkg.step)
    if blob:
        tp.share_tensor(torch.frombuffer(bytearray(blob), dtype=torch.uint8), pkg.step)


def receive(tp, inputs: StepInputs, device, last_step: int) -> StepPackage | None:
    """A follower's side: the next package, its rows staged (and sent to the device) as the leader's were;
    None when the leader says stop."""
    f = dict(zip(FIELDS, tp.share_header(None, len(FIELDS), last_step)))
    if f["stop"]:
        return None
    step, R = f["step"], f["R_pad"]
    body = tp.share_tensor(torch.empty((R, inputs.width + (6 if f["sampling"] != GREEDY else 0)), dtype=torch.long),
                           step)
    inputs.stage_received(body[:, :inputs.width], R)
    values = None
    if f["sampling"] != GREEDY:
        rest = body[:, inputs.width:]
        values = (rest[:, :3].contiguous(), rest[:, 3:].contiguous().view(torch.float64))
    sampling = ({"all_greedy": values is None, "filter": f["sampling"] == FILTERED}, values)
    adjust = None
    if f["adjust"]:
        blob = tp.share_tensor(torch.empty(f["adjust"], dtype=torch.uint8), step)
        adjust = pickle.loads(blob.numpy().tobytes()).to(device)
    sizes = StepSizes(R, f["K"], f["T_dec"], f["T"], f["T1"], k=f["k"])
    return StepPackage(step, sizes, bool(f["drafter_runs"]), f["logprobs"] - 1, sampling, adjust)


def stop(tp, last_step: int) -> None:
    """The leader's last package: its followers' loops end."""
    tp.share_header([1] + [0] * (len(FIELDS) - 1), len(FIELDS), last_step)
