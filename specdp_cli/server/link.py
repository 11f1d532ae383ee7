"""The link between the HTTP frontend and the ranks: one authenticated TCP connection per rank
(`multiprocessing.connection`), pickled tuples both ways.

frontend -> rank: ("add", id, prompt_ids, params, seed) | ("abort", id) | ("wake",) | ("shutdown",)
rank -> frontend: ("hello", rank) | ("out", [(id, new_token_ids, finish_reason|None, final_text|None,
                  stats|None, logprobs|None), ...], {k: steps run with k since the last "out"},
                  (running, waiting, kv_cache_usage, preemptions so far)) | ("bye", rank)
"""
from __future__ import annotations

import secrets
import threading
from multiprocessing.connection import Connection, Listener


def new_link_spec(host: str, port: int = 0) -> dict:
    return {"host": host, "port": port, "authkey": secrets.token_hex(16)}


def link_address(spec: dict) -> tuple[tuple[str, int], bytes]:
    return (spec["host"], int(spec["port"])), bytes.fromhex(spec["authkey"])


class RankLink:
    def __init__(self, world: int, spec: dict, on_message, on_lost):
        address, authkey = link_address(spec)
        self.listener = Listener(address, authkey=authkey)
        self.spec = {**spec, "port": self.listener.address[1]}
        self.world = world
        self.on_message, self.on_lost = on_message, on_lost
        self.conns: dict[int, Connection] = {}
        self.up: set[int] = set()
        self._send_locks = {r: threading.Lock() for r in range(world)}
        self._accepted = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="specdp-accept").start()

    def _accept(self) -> None:
        while len(self.conns) < self.world:
            try:
                conn = self.listener.accept()
                hello = conn.recv()
            except (OSError, EOFError, ValueError):
                continue                      # a stray or unauthenticated connection
            if not (isinstance(hello, tuple) and hello[0] == "hello" and 0 <= hello[1] < self.world):
                conn.close()
                continue
            rank = hello[1]
            self.conns[rank] = conn
            self.up.add(rank)
            threading.Thread(target=self._read, args=(rank, conn), daemon=True, name=f"specdp-rank{rank}").start()
        self._accepted.set()

    def _read(self, rank: int, conn: Connection) -> None:
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "bye":
                    break
                self.on_message(rank, msg)
        except (EOFError, OSError):
            pass
        self.up.discard(rank)
        self.on_lost(rank)

    def wait_connected(self, timeout: float) -> bool:
        return self._accepted.wait(timeout)

    @property
    def all_up(self) -> bool:
        return self._accepted.is_set() and len(self.up) == self.world

    def send(self, rank: int, msg) -> bool:
        conn = self.conns.get(rank)
        if conn is None or rank not in self.up:
            return False
        try:
            with self._send_locks[rank]:
                conn.send(msg)
            return True
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        try:
            self.listener.close()
        except OSError:
            pass
