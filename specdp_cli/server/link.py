"""The link between the HTTP frontend and the ranks: one authenticated connection per rank
(`multiprocessing.connection`'s framing and handshake) — a Unix socket when the ranks run on the frontend's machine,
TCP when some run on others — tuples of plain values (str, int, float, None, lists,
tuples, dicts) both ways, encoded by `marshal`: a step's message at 32 requests encodes and decodes in about three
quarters of pickle's time (`benchmarks/link_codec.py`: 4.8 and 7.5 µs against 6.4 and 10.0), and nothing but values
can come out of it.

frontend -> rank: ("add", id, prompt_ids, params, seed, prompt block hashes) | ("abort", id) | ("wake",) | ("shutdown",)
                  (the hashes, with prefix caching on: the prompt's full blocks' chained hashes, `block_hash.joined`)
rank -> frontend: ("hello", rank) | ("out", [(id, new_token_ids, finish_reason|None, stop_text_end|error|None,
                  stats|None, logprobs|None), ...]) | ("out", [...], {k: steps run with k since the rank's state
                  last went out}, the rank's state (server/rank.py's `_state`)) | ("bye", rank)

The frontend reads the ranks' messages on its event loop (a reader callback per connection parses the
connection's frames as they arrive), not on threads: a thread would need the GIL from the busy event
loop for each message (up to the 5 ms switch interval) and a hop back to it. Tokens go to the frontend,
which detokenizes; a rank sends only ids.
"""
from __future__ import annotations

import marshal
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from multiprocessing.connection import Connection, Listener


def new_link_spec(host: str, port: int = 0) -> dict:
    """A TCP link: the frontend listens on host:port (0: a free port)."""
    return {"host": host, "port": port, "authkey": secrets.token_hex(16)}


def local_link_spec() -> dict:
    """A link to ranks on this machine: a Unix socket. A message costs its sender less than over loopback TCP, whose
    send runs the receiving side's TCP processing too (a 2 KB message to a waiting reader process: 10–13 against 15–18
    µs on the development machine), and a rank sends one every step. (Where the temporary directory's path is too
    long for a Unix socket, `RankLink` listens on loopback TCP instead.)"""
    return {"unix": True, "authkey": secrets.token_hex(16)}


def link_address(spec: dict) -> tuple[str | tuple[str, int], bytes]:
    """The listener's address (a Unix socket's path, or (host, port)) and the link's key."""
    if spec.get("unix"):
        return spec["path"], bytes.fromhex(spec["authkey"])
    return (spec["host"], int(spec["port"])), bytes.fromhex(spec["authkey"])


# A request ("add") goes in marshal's version 2, which writes every value out: from version 3 on marshal notes each
# value that may recur in a table, an entry per prompt token (`benchmarks/link_codec.py --prompt 1500`: 40 against 15
# µs to encode on the development machine). The rest (step messages: few values, strings that recur) in the current
# version, whose references make them a third smaller (2,167 against 3,169 bytes at 32 requests).
REQUEST_MARSHAL_VERSION = 2


def send_message(conn: Connection, msg) -> None:
    """msg (plain values only) in the connection's framing."""
    conn.send_bytes(marshal.dumps(msg, REQUEST_MARSHAL_VERSION if msg[0] == "add" else marshal.version))


def recv_message(conn: Connection):
    """The next message on the connection (waiting for it)."""
    return marshal.loads(conn.recv_bytes())


def no_delay(conn: Connection) -> None:
    """TCP_NODELAY on a link connection (multiprocessing leaves Nagle's algorithm on). With it on, a
    message sent while the previous one is unacknowledged waits for that ACK, which the receiver
    delays up to 40 ms: a rank's step messages (and the frontend's requests) stalled 40 ms at a time,
    several times a second. (A Unix socket has no such delay.)"""
    sock = socket.socket(fileno=os.dup(conn.fileno()))       # the same socket; closing the copy keeps it
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()


class Frames:
    """multiprocessing.connection's framing, parsed from bytes as they arrive: a 4-byte big-endian size
    (-1: an 8-byte size follows), then the message (`send_message`)."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> list:
        self.buf += data
        out, at = [], 0
        while len(self.buf) - at >= 4:
            (n,), head = struct.unpack_from("!i", self.buf, at), 4
            if n == -1:
                if len(self.buf) - at < 12:
                    break
                (n,), head = struct.unpack_from("!Q", self.buf, at + 4), 12
            if len(self.buf) - at < head + n:
                break
            out.append(marshal.loads(memoryview(self.buf)[at + head:at + head + n]))
            at += head + n
        del self.buf[:at]
        return out


class RankLink:
    """on_message(rank, msg) and on_lost(rank) run on the event loop given to `attach`."""

    def __init__(self, world: int, spec: dict, on_message, on_lost):
        # a Unix socket in a directory of its own (multiprocessing's default one outlives a process that ends with
        # os._exit); where its path would pass 107 bytes (103 on macOS), loopback TCP
        self._dir = tempfile.mkdtemp(prefix="specdp-link-") if spec.get("unix") else None
        if self._dir is not None and len(os.fsencode(os.path.join(self._dir, "link"))) >= 100:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
            spec = {k: v for k, v in spec.items() if k != "unix"} | {"host": "127.0.0.1", "port": 0}
        if self._dir is not None:
            self.listener = Listener(os.path.join(self._dir, "link"), "AF_UNIX", authkey=bytes.fromhex(spec["authkey"]))
            self.spec = {**spec, "path": self.listener.address}
        else:
            address, authkey = link_address(spec)
            self.listener = Listener(address, authkey=authkey)
            self.spec = {**spec, "port": self.listener.address[1]}
        self.world = world
        self.on_message, self.on_lost = on_message, on_lost
        self.conns: dict[int, Connection] = {}
        self.up: set[int] = set()
        self.loop = None
        self._lock = threading.Lock()             # conns accepted vs the loop attached: each one watched once
        self._watched: set[int] = set()
        self._accepted = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="specdp-accept").start()

    def _accept(self) -> None:
        while len(self.conns) < self.world:
            try:
                conn = self.listener.accept()
                no_delay(conn)
                hello = recv_message(conn)
            except (OSError, EOFError, ValueError):
                continue                      # a stray or unauthenticated connection
            if not (isinstance(hello, tuple) and hello[0] == "hello" and 0 <= hello[1] < self.world):
                conn.close()
                continue
            rank = hello[1]
            with self._lock:
                self.conns[rank] = conn
                self.up.add(rank)
                loop = self.loop
            if loop is not None:
                loop.call_soon_threadsafe(self._watch, rank)
        self._accepted.set()

    def attach(self, loop) -> None:
        """Read the ranks' messages on `loop` (the running event loop) from now on."""
        with self._lock:
            self.loop = loop
            ranks = list(self.conns)
        for rank in ranks:
            self._watch(rank)

    def _watch(self, rank: int) -> None:
        if rank in self._watched:
            return
        self._watched.add(rank)
        fd, frames = self.conns[rank].fileno(), Frames()
        self.loop.add_reader(fd, self._readable, rank, fd, frames)

    def _readable(self, rank: int, fd: int, frames: Frames) -> None:
        try:
            data = os.read(fd, 1 << 20)       # readable: returns what has arrived, without waiting
        except OSError:
            data = b""
        msgs = frames.feed(data) if data else []
        for msg in msgs:
            if msg[0] == "bye":
                data = b""
                break
            self.on_message(rank, msg)
        if not data:                          # the rank closed the link (or said bye)
            self.loop.remove_reader(fd)
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
            send_message(conn, msg)    # from the event loop's thread (or after it ended): one sender at a time
            return True
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        try:
            self.listener.close()
        except OSError:
            pass
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
