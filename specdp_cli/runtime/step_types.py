"""What one engine step hands from phase to phase (schedule -> execute -> update), as vLLM v1's
SchedulerOutput / ModelRunnerOutput do: small typed records, built once per step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from .scheduler import Sequence, StepPlan
from .step_inputs import RowSpec, StepInputs

WIDE_CHUNKS, WIDE_DRAFTER = 1, 2          # StepSync.wide bits: prompt chunks (every forward wide); a drafter catch-up


class StepSync(NamedTuple):
    """One rank's row of the step sync (one integer each): what every rank of a lockstep step agrees on
    before its first forward, and what the next step's k is chosen from. A tuple: it is the row the sync
    sends (built once a step on a path where microseconds count)."""
    rows: int                 # rows of the step's forwards
    drafter_forwards: int     # K: drafter forwards the rank plans
    window: int               # the verification window: 1 + draft slots (1: no drafts)
    wide: int                 # WIDE_* bits
    has_work: int             # the rank holds rows or requests
    received: int             # frontend messages received (a server rank; see server/rank.py)
    batch: int                # running sequences (the next step's k: spec_length.py)
    preferred_k: int          # the rank's preferred k for the step after
    feeds_drafter: int        # some row feeds the drafter (a prompt chunk or a catch-up)
    stalled: int              # the rank's last step ended a stall (progress.py): every rank stops


@dataclass(slots=True)
class StepSizes:
    """What every rank of a lockstep step agrees on before its first forward."""
    R_pad: int            # rows of every forward of the step (a CUDA graph size)
    K: int                # drafter forwards
    T_dec: int            # the verification window: 1 + draft slots
    T: int                # tokens per row of the target forward (T_dec, or the prompt-chunk width)
    T1: int               # tokens per row of the first drafter forward (2, or the prompt-chunk width)
    k: int = 0            # the step's k (agreed at the last step's sync: spec_length.py)


@dataclass(slots=True)
class ScheduledStep:
    """The schedule phase's output: which sequences run and how, before any rank has synced."""
    step: int
    k: int                        # the step's k (agreed at the last step's sync)
    plan: StepPlan                # decode rows with their k_eff, prompt chunks, preemptions
    rows: list[RowSpec]           # the forwards' rows: decode rows first, then prompt-chunk pieces
    n_drafts: list[int]           # drafts of each decode row
    sync: StepSync                # this rank's row of the step sync
    t_start: float                # perf_counter at the step's start (the adaptive k's step times)


@dataclass(slots=True)
class StepContext:
    """What a step's device work reads (the drafters too)."""
    step: int
    rows: list[RowSpec]
    sizes: StepSizes
    inputs: StepInputs
    rt: dict                                      # sampling settings of the R_pad rows
    publish: Callable[[str], None]
    graphs: bool                                  # replay CUDA graphs (where captured)
    drafter_runs: bool                            # the drafter phase runs: it drafts, catches up or takes prompt chunks
    adjust: object = None                         # logits_process.LogitsAdjust of the rows asking for one, or None
    logprobs: int = -1                            # alternatives a token the step reports (-1: no log-probabilities)


@dataclass(slots=True)
class DeviceResult:
    """The execute phase's output, on the host: per row (a list of ints) its tokens [:W], how many count
    (column W) and the drafts proposed for its next step (columns W + 1..; an EAGLE head or MTP layer)."""
    table: list | tuple
    W: int
    proposed: bool
    logprobs: tuple | None = None     # (emitted tokens' log-probabilities [n, W], top ids [n, W, k], top values)


@dataclass(slots=True)
class LaunchedStep:
    """A step whose device work is queued: its schedule, sizes, and where its results land on the host (a view
    of a pinned buffer, valid once `event` has completed; event None: already there)."""
    sched: ScheduledStep
    sizes: StepSizes
    table: object                     # torch.Tensor [rows, W + 1 (+ K)] on the host, or None (no rows)
    event: object                     # torch.cuda.Event or None
    proposed: bool
    logprobs: tuple | None            # device tensors (their copy waits for the step), or None


@dataclass
class StepOutput:
    seq: Sequence
    new_tokens: list[int]
    finished: bool
    logprobs: list | None = None      # per new token: (its log-probability, [(token id, log-probability)] top ones)
