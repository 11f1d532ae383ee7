"""Fault injection (`SPECDP_FAULT`), to recreate known hangs and prove that specdp catches them.

  skip-drafter:R           rank R skips the drafter phase on steps where it has nothing to draft,
                           even under policy dummy (vLLM PR #40589)
  single-dummy-forward:R   rank R runs 1 drafter forward instead of k over a padding batch (vLLM PR #26217)
  exit:R:S                 rank R exits with status 3 at the start of its step S (steps count from 1)
  slow:R:MS                rank R is a straggler: each of its steps takes MS milliseconds longer (a slower
                           host); without lockstep its rank then serves fewer of the inputs
  freeze:R:N               rank R's N-th request (counting from 1, in the order requests reach the rank) never
                           gains a token: every step drops what it emitted (a livelock, for the progress guard)
  tp-skip:P:N              process P (a TP follower: P % tensor_parallel_size != 0) misses its N-th step
                           package: it runs the previous package's device work again (a collective missed)
  tp-alter:P:N             process P (a TP follower) decides on its own once: in its first step package from the
                           N-th on whose drafter phase drafts, it drafts nothing (its rows "do not fit the
                           drafter": vLLM #49027); check_collectives names it at once
  no-guard                 (tests) the step sync does not compare the ranks' drafter forwards: each rank
                           runs the count it planned. With one of the first two, this shows what the guard
                           prevents (the ranks' collectives no longer pair up: a timeout or a backend error)

Comma-separated. A malformed entry or a rank >= N is refused at start. R names a DP rank, P a process
(dp rank x tensor_parallel_size + TP rank).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

ENV = "SPECDP_FAULT"
EXIT_STATUS = 3


class FaultSpecError(ValueError):
    pass


@dataclass
class Faults:
    skip_drafter: set[int] = field(default_factory=set)
    single_dummy_forward: set[int] = field(default_factory=set)
    exit_at: dict[int, int] = field(default_factory=dict)    # rank -> step
    slow: dict[int, float] = field(default_factory=dict)     # rank -> seconds added to each step
    freeze: dict[int, int] = field(default_factory=dict)     # rank -> which of its requests never gains a token
    _arrived: int = field(default=0, init=False, repr=False)        # requests that reached this rank so far
    frozen_id: object = field(default=None, init=False, repr=False)  # the frozen request's id, once it arrived
    guard: bool = True                                       # the step sync compares drafter forwards
    tp_skip: dict[int, int] = field(default_factory=dict)    # process -> the step package it misses
    tp_alter: dict[int, int] = field(default_factory=dict)   # process -> from which package it decides alone

    @classmethod
    def parse(cls, text: str | None, world: int, tp: int = 1) -> "Faults":
        f = cls()
        for raw in (text or "").split(","):
            item = raw.strip()
            if not item:
                continue
            parts = item.split(":")
            try:
                nums = [int(p) for p in parts[1:]]
            except ValueError:
                nums = None
            kind = parts[0]
            if item == "no-guard":
                f.guard = False
                continue
            if kind in ("skip-drafter", "single-dummy-forward") and nums is not None and len(nums) == 1:
                (rank,) = nums
                (f.skip_drafter if kind == "skip-drafter" else f.single_dummy_forward).add(rank)
            elif kind == "exit" and nums is not None and len(nums) == 2 and nums[1] >= 1:
                rank = nums[0]
                f.exit_at[rank] = nums[1]
            elif kind == "slow" and nums is not None and len(nums) == 2 and nums[1] >= 0:
                rank = nums[0]
                f.slow[rank] = nums[1] / 1000
            elif kind == "freeze" and nums is not None and len(nums) == 2 and nums[1] >= 1:
                rank = nums[0]
                f.freeze[rank] = nums[1]
            elif kind in ("tp-skip", "tp-alter") and nums is not None and len(nums) == 2 and nums[1] >= 1:
                proc = nums[0]
                if not 0 <= proc < world * tp or proc % tp == 0:
                    raise FaultSpecError(f"{ENV}: {item!r} names process {proc}, which is not a TP follower (processes "
                                         f"0..{world * tp - 1}; a TP group's first, P % {tp} == 0, is its leader)")
                (f.tp_skip if kind == "tp-skip" else f.tp_alter)[proc] = nums[1]
                continue
            else:
                raise FaultSpecError(f"{ENV}: cannot read {item!r}; expected skip-drafter:R, "
                                     f"single-dummy-forward:R, exit:R:S (S >= 1), slow:R:MS, freeze:R:N (N >= 1), "
                                     f"tp-skip:P:N, tp-alter:P:N or no-guard, comma-separated")
            if not 0 <= rank < world:
                raise FaultSpecError(f"{ENV}: {item!r} names rank {rank}, but ranks are 0..{world - 1}")
        return f

    @classmethod
    def from_env(cls, world: int, tp: int = 1) -> "Faults":
        return cls.parse(os.environ.get(ENV), world, tp)

    def skips_package(self, proc: int, n: int) -> bool:
        """Whether process `proc` (a TP follower) misses its n-th step package."""
        return self.tp_skip.get(proc) == n

    def alter_package(self, proc: int, n: int, pkg):
        """Process `proc`'s n-th step package as it applies it: altered once under tp-alter (see above)."""
        first = self.tp_alter.get(proc)
        if first is None or n < first or not pkg.sizes.K:
            return pkg
        del self.tp_alter[proc]
        return replace(pkg, sizes=replace(pkg.sizes, K=0))

    def drafter_forwards(self, rank: int, has_draft: bool, wanted: int) -> int:
        """The drafter forwards rank `rank` actually runs when the engine wants `wanted`."""
        if not has_draft and wanted:
            if rank in self.skip_drafter:
                return 0
            if rank in self.single_dummy_forward:
                return 1
        return wanted

    def arrived(self, rank: int, req_id) -> None:
        """A request reached rank `rank` (freeze counts them)."""
        if rank in self.freeze:
            self._arrived += 1
            if self._arrived == self.freeze[rank]:
                self.frozen_id = req_id

    def exit_step(self, rank: int) -> int | None:
        return self.exit_at.get(rank)

    def step_delay(self, rank: int) -> float:
        return self.slow.get(rank, 0.0)
