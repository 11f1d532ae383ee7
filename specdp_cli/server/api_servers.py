"""API server processes beyond the first (`server.api_server_count`, vLLM's --api-server-count): one event loop's
Python caps the requests and tokens a second a frontend can take (on an H200 host about 900 short requests a
second), which small, fast models outrun. Each process here is a whole frontend — HTTP on the shared port
(SO_REUSEPORT), tokenization, its own link to every rank, detokenization, its share of /metrics — started by
`specdp serve` (run.py), which serves too and owns the ranks.

Their life, over a pipe each: the process sends its link's address ("spec"), the job is written with all of them,
the ranks connect, it sends "ready" and serves; on SIGTERM (from `specdp serve`, which drains its own meanwhile)
it drains its requests and sends "drained"; it closes its link only on "exit", sent after the ranks stopped, so a
rank never sees one of its links close while it serves.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

START_S = 120.0        # an API server process's start-up (imports, tokenizer), and its link's ranks connecting


class ApiServers:
    """The API server processes `specdp serve` started (none by default)."""

    def __init__(self):
        self.procs: list = []
        self.pipes: list = []
        self.specs: list[dict] = []
        self._signalled = False
        self._drained: set[int] = set()

    def start(self, n: int, cfg, plan, http_port: int, metrics_dir: str) -> str | None:
        """Start n processes serving on http_port; None, or why they could not start."""
        ctx = mp.get_context("spawn")
        for i in range(1, n + 1):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=api_server_main, args=(i, cfg, plan, http_port, metrics_dir, theirs),
                            name=f"specdp-api{i}", daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            self.pipes.append(ours)
        for i, pipe in enumerate(self.pipes, 1):
            kind, detail = self._recv(pipe, START_S)
            if kind != "spec":
                return f"API server process {i} did not start ({detail})"
            self.specs.append(detail)
        return None

    @staticmethod
    def _recv(pipe, timeout: float) -> tuple:
        """(kind, detail): a process's message, ("timeout", why) or ("exited", why)."""
        try:
            if pipe.poll(timeout):
                return pipe.recv()
            return ("timeout", "no answer")
        except (EOFError, OSError):
            return ("exited", "it exited; its error is above")

    def wait_ready(self, ranks_alive) -> str | None:
        """Each process's ranks connected and its app built: None, or why not."""
        for i, pipe in enumerate(self.pipes, 1):
            deadline = time.monotonic() + START_S
            while True:
                kind, detail = self._recv(pipe, 0.5)
                if kind == "ready":
                    break
                if kind != "timeout" or not ranks_alive() or time.monotonic() > deadline:
                    return f"API server process {i} is not ready ({detail})"
        return None

    def exited(self) -> str | None:
        """Why the server must stop, when one of the processes ended on its own."""
        for i, p in enumerate(self.procs, 1):
            if not p.is_alive():
                return f"API server process {i} exited (exit code {p.exitcode})"
        return None

    def signal(self) -> None:
        """SIGTERM each process once: it drains its requests."""
        if self._signalled:
            return
        self._signalled = True
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    def drained(self, timeout: float) -> None:
        """Signal the processes (if not yet) and wait, up to `timeout`, until each has drained or ended."""
        self.signal()
        deadline = time.monotonic() + timeout
        for i, (p, pipe) in enumerate(zip(self.procs, self.pipes)):
            while i not in self._drained and p.is_alive() and time.monotonic() < deadline:
                if self._recv(pipe, 0.2)[0] in ("drained", "exited"):
                    self._drained.add(i)

    def stop(self) -> None:
        """The ranks have stopped: the processes close their links and exit."""
        for pipe in self.pipes:
            try:
                pipe.send(("exit",))
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)


def api_server_main(index: int, cfg, plan, http_port: int, metrics_dir: str, pipe) -> None:
    """One API server process (see the module docstring)."""
    from rich.console import Console

    from . import event_loop
    from .link import RankLink, local_link_spec
    from .metrics import share_between_processes
    from .run import http_socket, make_app, make_frontend, serve_http

    share_between_processes(metrics_dir)
    frontend = make_frontend(cfg, plan)
    world = cfg.parallel.data_parallel_size
    # (several API servers: the ranks are on this machine)
    link = RankLink(world, local_link_spec(), frontend.on_message, frontend.on_lost)
    frontend.link = link
    code = 1
    try:
        pipe.send(("spec", link.spec))
        sock = http_socket(cfg.server.host, http_port)
        app = make_app(cfg, plan, frontend)
        while not link.wait_connected(0.5):
            if pipe.poll(0):          # `specdp serve` gave up before the ranks came up
                return
        frontend.metrics.ranks_up.set(world)
        pipe.send(("ready", None))
        # the parent reports failures; this process's console stays quiet
        code = event_loop.run(serve_http(app, frontend, cfg, plan, Console(stderr=True, quiet=True), sock),
                              cfg.server.event_loop)
        pipe.send(("drained", code))
        try:
            pipe.recv()               # "exit": the ranks have stopped
        except EOFError:
            pass
    except Exception:  # noqa: BLE001 - reported here; `specdp serve` sees the process end and stops
        import traceback

        traceback.print_exc()
    finally:
        link.close()
        os._exit(code)
