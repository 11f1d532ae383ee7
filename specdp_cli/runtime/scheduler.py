"""Continuous batching: which sequences run this step, with how many draft tokens, and which
prompt chunks are prefilled.

Every running sequence takes part in every step (its KV rows are preallocated, so there is no
preemption). New requests are admitted first-come first-served while slots are free; prompts are
prefilled within `max_num_batched_tokens` minus what the running sequences' verification needs,
in chunks when they do not fit whole. Slots are kept dense (0..n-1): when a sequence leaves, the
last one moves into its slot.

Lengths follow DESIGN.md's contract: L = prompt + generated; a sequence fits the drafter when
L + k <= D and then drafts k_eff = min(k, M - L - 1, max_tokens_left - 1).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .sampling import SamplingParams


@dataclass
class Request:
    id: Any
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos += [0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos))
        for i, v in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += v


class Sequence:
    def __init__(self, req: Request, slot: int, max_model_len: int):
        self.req = req
        self.slot = slot
        self.tokens = list(req.prompt_ids)
        self.num_prompt = len(req.prompt_ids)
        self.limit = min(max_model_len, self.num_prompt + req.params.max_tokens)  # L never passes this
        self.M = max_model_len
        self.target_len = 0          # positions held in the target's KV cache
        self.draft_len = 0           # positions held in the drafter's KV cache
        self.finish_reason: str | None = None
        self.stop_text_end: int | None = None   # where a matched stop string starts in the text
        self.stats = SpecStats()

    @property
    def L(self) -> int:
        return len(self.tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def in_prefill(self) -> bool:
        return self.target_len < self.num_prompt

    def k_eff(self, k: int, D: int) -> int:
        """Draft tokens this step (0 while prefilling, or when L + k > D)."""
        if self.in_prefill or self.L + k > D:
            return 0
        left = self.req.params.max_tokens - (self.L - self.num_prompt)
        return max(0, min(k, self.M - self.L - 1, left - 1))


@dataclass
class StepPlan:
    decode: list[tuple[Sequence, int]]            # (sequence, k_eff)
    prefill: list[tuple[Sequence, int, int]]      # (sequence, start, end) of a prompt chunk


class Scheduler:
    def __init__(self, num_slots: int, max_batched_tokens: int, k: int, max_model_len: int, D: int):
        self.num_slots = num_slots
        self.max_batched_tokens = max_batched_tokens
        self.k, self.M, self.D = k, max_model_len, D
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []      # index == slot

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        while self.waiting and len(self.running) < self.num_slots:
            self.running.append(Sequence(self.waiting.popleft(), len(self.running), self.M))
        decode = [(s, s.k_eff(self.k, self.D)) for s in self.running if not s.in_prefill]
        budget = self.max_batched_tokens - sum(1 + ke for _, ke in decode)
        prefill = []
        for s in self.running:
            if s.in_prefill and budget > 0:
                end = min(s.num_prompt, s.target_len + budget)
                prefill.append((s, s.target_len, end))
                budget -= end - s.target_len
        return StepPlan(decode, prefill)

    def remove(self, seq: Sequence) -> tuple[Sequence, int] | None:
        """Free `seq`'s slot. Returns (moved, from_slot) when the last sequence moved into it:
        its KV rows must be copied from `from_slot` to `moved.slot`."""
        last = self.running.pop()
        if last is seq:
            return None
        from_slot = last.slot
        self.running[seq.slot] = last
        last.slot = seq.slot
        return last, from_slot

    def abort(self, req_id) -> tuple[bool, Sequence | None]:
        """Drop a request: (found, the running sequence whose slot the caller must free)."""
        for i, r in enumerate(self.waiting):
            if r.id == req_id:
                del self.waiting[i]
                return True, None
        for s in self.running:
            if s.req.id == req_id:
                return True, s
        return False, None
