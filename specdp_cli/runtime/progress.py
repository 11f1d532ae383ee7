"""The progress guard (DESIGN.md, "Progress"): a rank's step loop that makes no progress stops and
says so, naming its sequences, instead of looping.

Progress is a sequence gaining a token, finishing or failing. A step can rightly make none only
while every sequence the rank holds is prefilling: a decode row always emits at least one token,
and a rank holding sequences always runs the oldest one (the scheduler never preempts it for
another, and it always gets its blocks). Prompts are prefilled oldest first with the step's whole
token budget, so the longest rightful stretch without progress is the prefill of one prompt of
max_model_len tokens, plus a step (a recomputation after a preemption stops one token short, and
its next step draws it). The guard allows twice that, plus a margin: a loop that runs longer is a
bug, and the sentence it gives is what to report.

What a stall does is the caller's choice: an offline job stops (every rank, at the next step's
sync), a server fails the stuck requests and goes on.
"""
from __future__ import annotations

MARGIN_STEPS = 8
SHOWN = 8                  # sequences a stall's sentence names one by one


class NoProgressError(RuntimeError):
    """A rank made no progress for the guard's number of steps (its own message names the sequences)."""
    kind = "no-progress"


class StalledPeerError(RuntimeError):
    """Another rank stalled: every rank of a lockstep job stops at the same step."""
    kind = "peer-stalled"


class ProgressGuard:
    def __init__(self, prefill_steps: int):
        """prefill_steps: the most steps the prefill of one max_model_len-token prompt takes."""
        self.limit = 2 * (prefill_steps + 1) + MARGIN_STEPS
        self.stalled = 0            # consecutive steps in which the rank held sequences and none made progress

    def after_step(self, held: bool, progressed: bool) -> bool:
        """Count one step; True when the rank has now gone `limit` steps without progress (the count
        then starts again)."""
        self.stalled = self.stalled + 1 if held and not progressed else 0
        if self.stalled < self.limit:
            return False
        self.stalled = 0
        return True


def describe_stall(rank: int, step: int, stalled: int, running, waiting, free_blocks: int, k: int, D: int,
                   M: int) -> str:
    """The sentence of a stall: where, for how long, and each sequence (id, length, k, blocks, phase)."""
    def one(s, state: str) -> str:
        if state == "waiting":
            phase = "waiting to be admitted" + (f" (preempted {s.preemptions} times)" if s.preemptions else "")
        elif s.in_prefill:
            phase = f"prefill ({s.target_len} of {s.prefill_len} tokens)"
        else:
            phase = "decode"
        return (f"request {s.req.id!r}: length {s.L} (prompt {s.num_prompt}, ends at {s.limit}), "
                f"k {s.k_eff(k, D) if state != 'waiting' else 0}, {len(s.blocks)} KV blocks held, {phase}")

    seqs = [one(s, "running") for s in running] + [one(s, "waiting") for s in waiting]
    if len(seqs) > SHOWN:
        seqs[SHOWN:] = [f"and {len(seqs) - SHOWN} more"]
    return (f"no progress on rank {rank} for {stalled} steps (steps {step - stalled + 1}-{step}): no sequence gained "
            f"a token, finished or failed (max_model_len {M}, {free_blocks} KV blocks free). "
            + "; ".join(seqs) + ". This is a bug in specdp: please report it with this message.")
