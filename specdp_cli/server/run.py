"""`specdp serve`: start the ranks, connect them to the HTTP frontend, serve until stopped.

Exit status: 0 after SIGTERM / Ctrl-C (in-flight requests drained, bounded wait), 1 when a rank
fails (then /health answers 503 for a few seconds, in-flight requests end with an error, and the
server exits within `collective_timeout_s` + 30 s).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import time

from rich.console import Console

from ..config import Config
from ..launch import Ranks
from ..modeldir import load_tokenizer
from ..plan import Plan
from ..prompts import PromptEncoder
from .link import RankLink, new_link_spec

DRAIN_S = 30.0          # SIGTERM: how long in-flight requests may take to finish
FAILED_GRACE_S = 3.0    # after a rank failure /health answers 503 this long before the exit


def port_problem(host: str, port: int) -> str | None:
    """Why the HTTP server could not listen on host:port (in use, no such address), or None."""
    import socket

    if port == 0:
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn binds
            sock.bind((host, port))
    except OSError as e:
        return (f"cannot listen on {host}:{port}: {e.strerror or e} — stop what uses the port or pick another "
                f"(--port)")
    return None


def link_spec(cfg: Config) -> dict:
    par = cfg.parallel
    if par.num_machines == 1:
        return new_link_spec("127.0.0.1")
    # ranks on other machines reach the frontend on machine 0 at main_process_port + 1
    key = os.environ.get("SPECDP_LINK_KEY") or hashlib.sha256(
        f"{par.main_process_ip}:{par.main_process_port}:{cfg.model}".encode()).hexdigest()[:32]
    return {"host": par.main_process_ip, "port": par.main_process_port + 1, "authkey": key}


def run_server(cfg: Config, plan: Plan, console: Console, ranks: Ranks) -> int:
    """Serve until stopped; `ranks` are this machine's ranks, started and waiting for the job."""
    from .app import build_app
    from .frontend import Frontend
    from .metrics import Metrics
    from .routing import PrefixIndex

    world = cfg.parallel.data_parallel_size
    frontend_here = cfg.parallel.machine_rank == 0
    spec = link_spec(cfg)
    index = PrefixIndex(world, cfg.cache.block_size) if cfg.cache.enable_prefix_caching and world > 1 else None
    frontend = Frontend(world, Metrics(plan.model_name, world, cfg.max_model_len), cfg.server.max_queue,
                        cfg.scheduler.max_num_seqs, index)
    link = None
    if frontend_here:
        link = RankLink(world, {**spec, "host": "0.0.0.0" if cfg.parallel.num_machines > 1 else spec["host"]},
                        frontend.on_message, frontend.on_lost)
        spec = {**spec, "port": link.spec["port"]}
        frontend.link = link
    run_dir = ranks.run_dir
    run_dir.write_job(cfg, plan, "serve", ranks.started_at, link=spec)
    try:
        if not frontend_here:
            rc = ranks.wait()
            return 0 if rc in (0, 130, 143) else 1
        console.print(f"starting {world} rank(s)…")
        while not link.wait_connected(0.5):
            if ranks.poll() is not None:
                console.print("[bold red]the ranks failed to start[/]:")
                console.print(ranks.failure_message() + "\n" + ranks.log_tail(), markup=False)
                return 1
        for line in ranks.ready_lines():          # each rank's start-up line (the ranks log to a file)
            console.print(line, markup=False, highlight=False)
        tokenizer = load_tokenizer(cfg.tokenizer_path)
        app = build_app(frontend, PromptEncoder(tokenizer, cfg.chat_template), tokenizer, plan.model_name,
                        cfg.max_model_len, cfg.sampling, cfg.server.api_key)
        return asyncio.run(_serve(app, frontend, ranks, cfg, plan, console))
    finally:
        if link is not None:
            for r in range(world):
                link.send(r, ("shutdown",))
        # the ranks end on "shutdown"; after a rank failed, one that cannot (frozen, stuck in a collective) is
        # stopped sooner
        deadline = time.monotonic() + (5 if frontend.failed else 20)
        while ranks.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if ranks.poll() is None:
            ranks.stop()
        if link is not None:
            link.close()
        run_dir.cleanup()


async def _serve(app, frontend, ranks: Ranks, cfg: Config, plan: Plan, console: Console) -> int:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):        # specdp handles SIGINT / SIGTERM itself (drain first)
            yield

        def install_signal_handlers(self) -> None:    # older uvicorn
            pass

    server = Server(uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level="warning",
                                   lifespan="off", timeout_graceful_shutdown=5))
    frontend.link.attach(asyncio.get_running_loop())       # the ranks' messages are read on this loop
    exit_code = {"code": 0}
    stop = asyncio.Event()

    def on_signal() -> None:
        if not frontend.draining:
            frontend.draining = True
            n = len(frontend.inflight)
            console.print(f"stopping: draining {n} in-flight request{'' if n == 1 else 's'} (up to {DRAIN_S:.0f} s), "
                          f"refusing new ones…")
            stop.set()

    loop = asyncio.get_running_loop()
    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, on_signal)

    async def watch() -> None:
        failed_at = None
        while True:
            if ranks.poll() is not None and frontend.failed is None:
                frontend.rank_lost(-1, "the ranks exited")
            if frontend.failed is not None:
                if failed_at is None:
                    failed_at = time.monotonic()
                    console.print("[bold red]a rank failed[/]: ", end="")
                    console.print(frontend.failed, markup=False)
                if time.monotonic() - failed_at > FAILED_GRACE_S or ranks.poll() is not None and \
                        time.monotonic() - failed_at > 1.0:
                    exit_code["code"] = 1
                    stop.set()
                    return
            if stop.is_set():
                return
            await asyncio.sleep(0.2)

    async def drain() -> None:
        await stop.wait()
        if exit_code["code"] == 0:
            deadline = time.monotonic() + DRAIN_S
            while frontend.inflight and time.monotonic() < deadline and frontend.failed is None:
                await asyncio.sleep(0.1)
            for inf in list(frontend.inflight.values()):
                frontend.abort(inf)
        server.should_exit = True

    async def announce() -> None:         # once the socket is listening, not before
        while not server.started:
            await asyncio.sleep(0.05)
        console.print(f"serving [bold]{frontend.metrics.model}[/] on http://{cfg.server.host}:{cfg.server.port}/v1 "
                      f"({frontend.world} rank(s), dp_sync {plan.dp_sync})")

    tasks = [asyncio.create_task(watch()), asyncio.create_task(drain()), asyncio.create_task(announce())]
    try:
        await server.serve()
    except SystemExit:          # uvicorn gives up this way when it cannot bind
        pass
    finally:
        for t in tasks:
            t.cancel()
    if not server.started:
        console.print(f"[bold red]cannot serve[/]: the HTTP server could not start on {cfg.server.host}:"
                      f"{cfg.server.port} (see the message above)")
        return 1
    if exit_code["code"] == 1:
        console.print(ranks.failure_message(), markup=False)
    elif frontend.draining:
        console.print("stopped")
    return exit_code["code"]
