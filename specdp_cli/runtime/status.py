"""What each rank is doing, readable from outside: the parent CLI reads it to say which rank failed
and where ("rank 1 exited during step 57, drafter forward 3/4").

Two files per rank in the run directory:
  rank{r}.status  a fixed-size record rewritten in place at every phase change, so even a rank killed
                  with SIGKILL leaves its last phase behind. The rank writes it through a shared mapping of
                  the file (the page cache the reader's read() sees): a store, where a pwrite was a system
                  call, about 7 a step (1.7 against 0.4 µs each on the development machine);
  rank{r}.exit    a JSON record written once when the rank ends: ok, error, fault, out-of-step,
                  peer-lost or terminated, with a message.
"""
from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass

RECORD = 192


class StatusBoard:
    def __init__(self, run_dir: str | None, rank: int):
        self.rank = rank
        self.run_dir = run_dir
        self.step = 0
        self.what = "starting"
        self._record = None
        if run_dir:
            fd = os.open(os.path.join(run_dir, f"rank{rank}.status"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, RECORD)
                self._record = mmap.mmap(fd, RECORD)
            finally:
                os.close(fd)                     # the mapping keeps the file
            self._pid = os.getpid()
            self.set(0, "starting")

    def set(self, step: int, what: str) -> None:
        self.step, self.what = step, what
        if self._record is not None:
            line = f"{self._pid}\t{step}\t{what}".encode()[:RECORD - 1]
            self._record[:] = line.ljust(RECORD - 1) + b"\n"

    @property
    def where(self) -> str:
        return where(self.step, self.what)

    def exit(self, kind: str, message: str, code: int) -> None:
        if not self.run_dir:
            return
        rec = {"rank": self.rank, "kind": kind, "message": message, "code": code,
               "step": self.step, "phase": self.what}
        tmp = os.path.join(self.run_dir, f"rank{self.rank}.exit.tmp")
        with open(tmp, "w") as fh:
            json.dump(rec, fh)
        os.replace(tmp, os.path.join(self.run_dir, f"rank{self.rank}.exit"))


def where(step: int, what: str) -> str:
    if step <= 0:
        return what
    return f"step {step}, {what}"


@dataclass
class RankState:
    rank: int
    pid: int | None
    step: int
    phase: str
    exit: dict | None

    @property
    def where(self) -> str:
        return where(self.step, self.phase)


def read_states(run_dir: str, ranks: range) -> list[RankState]:
    out = []
    for r in ranks:
        pid, step, phase, rec = None, 0, "not started", None
        try:
            with open(os.path.join(run_dir, f"rank{r}.status"), "rb") as fh:
                parts = fh.read(RECORD).decode(errors="replace").strip().split("\t")
            if len(parts) == 3:
                pid, step, phase = int(parts[0]), int(parts[1]), parts[2].strip()
        except (OSError, ValueError):
            pass
        try:
            with open(os.path.join(run_dir, f"rank{r}.exit")) as fh:
                rec = json.load(fh)
        except (OSError, ValueError):
            pass
        out.append(RankState(r, pid, step, phase, rec))
    return out
