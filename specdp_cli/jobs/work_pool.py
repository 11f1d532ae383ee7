"""The inputs of one machine, taken by its ranks as they have room.

Every rank of a machine holds the same list; a claim counter in the run directory (8 bytes, advanced
under an exclusive file lock) says how many of them are taken. A rank takes inputs whenever it has
free batch slots (at most its share of what is left: remaining / ranks, rounded up, so the first rank
to ask cannot take a small job whole), so a rank that steps faster serves more of them and the ranks
finish together:
with a fixed split, one rank whose host runs 20 % slower (seen on H200 machines: ranks' step times
differ by that much from process to process) would set the end of the whole job. No collective is
involved: claims are local file operations, made between steps, so they cannot put ranks out of
step. Without a path (one rank) the counter is private.
"""
from __future__ import annotations

import fcntl
import os
import struct
from typing import Generic, TypeVar

T = TypeVar("T")


class WorkPool(Generic[T]):
    def __init__(self, items: list[T], path: str | None = None, sharers: int = 1):
        self.items = items
        self.sharers = max(1, sharers)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644) if path else None
        self._next = 0                 # the private counter (no path)
        self.taken = 0                 # how many this rank took
        self.empty = not items

    def take(self, n: int) -> list[T]:
        """Up to n inputs not taken by any rank of this machine yet (and at most this rank's share of
        them), in list order."""
        if n <= 0 or self.empty:
            return []
        if self._fd is None:
            a = self._next
            b = self._next = a + self._share(a, n)
        else:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, 8, 0)
                a = struct.unpack("<q", raw)[0] if len(raw) == 8 else 0      # a new file: nothing taken
                b = a + self._share(a, n)
                if b > a:
                    os.pwrite(self._fd, struct.pack("<q", b), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        if b >= len(self.items):
            self.empty = True
        got = self.items[a:b]
        self.taken += len(got)
        return got

    def _share(self, taken: int, n: int) -> int:
        left = max(0, len(self.items) - taken)
        return min(n, -(-left // self.sharers))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
