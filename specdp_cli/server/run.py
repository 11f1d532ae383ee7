"""`specdp serve`: start the ranks, connect them to the HTTP frontend, serve until stopped.

Exit status: 0 after SIGTERM / Ctrl-C (in-flight requests drained, bounded wait), 1 when a rank
fails (then /health answers 503 for a few seconds, in-flight requests end with an error, and the
server exits within `collective_timeout_s` + 30 s).

With `server.api_server_count` N > 1 this process serves HTTP alongside N - 1 API server processes
(`api_servers.py`), all listening on the same port (SO_REUSEPORT: the kernel spreads the connections), each
with its own link to every rank.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import tempfile
import time

from rich.console import Console

from ..config import Config
from ..launch import Ranks
from ..modeldir import load_tokenizer
from ..plan import Plan
from ..prompts import PromptEncoder
from ..runtime.heap import freeze_startup_heap
from . import event_loop
from .link import RankLink, local_link_spec, new_link_spec

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
        return local_link_spec()
    # ranks on other machines reach the frontend on machine 0 at main_process_port + 1
    key = os.environ.get("SPECDP_LINK_KEY") or hashlib.sha256(
        f"{par.main_process_ip}:{par.main_process_port}:{cfg.model}".encode()).hexdigest()[:32]
    return {"host": par.main_process_ip, "port": par.main_process_port + 1, "authkey": key}


def make_frontend(cfg: Config, plan: Plan):
    """This process's frontend (without its link): metrics, routing, and its share of server.max_queue."""
    from .frontend import Frontend
    from .metrics import Metrics
    from .routing import PrefixIndex

    world = cfg.parallel.data_parallel_size
    caching = cfg.cache.enable_prefix_caching
    index = PrefixIndex(world) if caching and world > 1 else None
    max_queue = -(-cfg.server.max_queue // cfg.server.api_server_count)
    return Frontend(world, Metrics(plan.model_name, world, cfg.max_model_len), max_queue,
                    cfg.scheduler.max_num_seqs, index, cfg.cache.block_size if caching else None)


def make_app(cfg: Config, plan: Plan, frontend):
    from .app import build_app

    tokenizer = load_tokenizer(cfg.tokenizer_path)
    return build_app(frontend, PromptEncoder(tokenizer, cfg.chat_template), tokenizer, plan.model_name,
                     cfg.max_model_len, cfg.sampling, cfg.server.api_key)


def http_socket(host: str, port: int):
    """A listening socket on host:port that other processes can listen on too (SO_REUSEPORT). Made as TCP by name:
    asyncio sets TCP_NODELAY only on connections of a socket whose protocol says TCP (with Nagle's algorithm on,
    a stream's chunks waited for the client's delayed ACKs: 40 ms stalls)."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def run_server(cfg: Config, plan: Plan, console: Console, ranks: Ranks) -> int:
    """Serve until stopped; `ranks` are this machine's ranks, started and waiting for the job."""
    from .api_servers import ApiServers
    from .metrics import share_between_processes

    world = cfg.parallel.data_parallel_size
    frontend_here = cfg.parallel.machine_rank == 0
    n_api = cfg.server.api_server_count
    spec = link_spec(cfg)
    metrics_dir = tempfile.mkdtemp(prefix="specdp-metrics-") if frontend_here and n_api > 1 else None
    if metrics_dir:
        share_between_processes(metrics_dir)
    frontend = make_frontend(cfg, plan)
    link = sock = None
    others = ApiServers()
    if frontend_here:
        if cfg.parallel.num_machines == 1:
            link = RankLink(world, spec, frontend.on_message, frontend.on_lost)
            spec = link.spec
        else:
            link = RankLink(world, {**spec, "host": "0.0.0.0"}, frontend.on_message, frontend.on_lost)
            spec = {**spec, "port": link.spec["port"]}
        frontend.link = link
    run_dir = ranks.run_dir
    try:
        if frontend_here and n_api > 1:
            try:
                sock = http_socket(cfg.server.host, cfg.server.port)
            except OSError as e:
                console.print(f"[bold red]cannot serve[/]: cannot listen on {cfg.server.host}:{cfg.server.port}: "
                              f"{e.strerror or e} — stop what uses the port or pick another (--port)", highlight=False)
                return 1
            problem = others.start(n_api - 1, cfg, plan, sock.getsockname()[1], metrics_dir)
            if problem:
                console.print(f"[bold red]cannot serve[/]: {problem}", highlight=False)
                return 1
        run_dir.write_job(cfg, plan, "serve", ranks.started_at, links=[spec] + others.specs)
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
        frontend.metrics.ranks_up.set(world)
        app = make_app(cfg, plan, frontend)
        problem = others.wait_ready(lambda: ranks.poll() is None)
        if problem:
            console.print(f"[bold red]cannot serve[/]: {problem}", highlight=False)
            return 1
        return event_loop.run(serve_http(app, frontend, cfg, plan, console, sock, ranks=ranks, others=others),
                              cfg.server.event_loop)
    finally:
        others.drained(DRAIN_S + 5)           # the other API servers' requests end before the ranks stop
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
        others.stop()
        if link is not None:
            link.close()
        if sock is not None:
            sock.close()
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        run_dir.cleanup()


async def serve_http(app, frontend, cfg: Config, plan: Plan, console: Console, sock=None, ranks: Ranks | None = None,
                     others=None) -> int:
    """Serve `app` until a signal (drain, then 0) or a failure (1): of a rank (`frontend.failed`; the ranks'
    processes when this process started them) or of another API server process (`others`). `sock`: a listening
    socket shared with the other API servers (None: uvicorn binds host:port itself)."""
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
            if others is not None:
                others.signal()                # they drain theirs meanwhile
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
            # an API server process that ended is why the ranks stop too (each rank ends on a link lost), and
            # why this one then sees its ranks' links close: say so rather than "a rank stopped answering"
            gone = others.exited() if others is not None and not frontend.draining else None
            if gone and not exit_code.get("cause"):
                exit_code["cause"] = f"{gone}; the ranks stopped with it"
                if failed_at is None:
                    frontend.failed = None     # a link loss it caused, not reported yet: report the cause instead
                frontend.rank_lost(-1, exit_code["cause"])
            elif ranks is not None and ranks.poll() is not None and frontend.failed is None:
                frontend.rank_lost(-1, "the ranks exited")
            if frontend.failed is not None:
                if failed_at is None:
                    failed_at = time.monotonic()
                    console.print("[bold red]the server failed[/]: " if exit_code.get("cause") else
                                  "[bold red]a rank failed[/]: ", end="")
                    console.print(frontend.failed, markup=False)
                if time.monotonic() - failed_at > FAILED_GRACE_S or (ranks is None or ranks.poll() is not None) \
                        and time.monotonic() - failed_at > 1.0:
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
        port = sock.getsockname()[1] if sock is not None else cfg.server.port
        n_api = cfg.server.api_server_count
        console.print(f"serving [bold]{frontend.metrics.model}[/] on http://{cfg.server.host}:{port}/v1 "
                      f"({frontend.world} rank(s), dp_sync {plan.dp_sync}"
                      f"{f', {n_api} API server processes' if n_api > 1 else ''})")

    tasks = [asyncio.create_task(watch()), asyncio.create_task(drain())]
    if ranks is not None:
        tasks.append(asyncio.create_task(announce()))
    # start-up is over: its objects out of the garbage collector's view (runtime/heap.py). Unfrozen, a full
    # collection stalled the event loop 40-50 ms every few hundred requests and cost a quarter of the frontend's CPU
    # under load (`benchmarks/frontend_bench.py --no-freeze`)
    freeze_startup_heap()
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    except SystemExit:          # uvicorn gives up this way when it cannot bind
        pass
    finally:
        for t in tasks:
            t.cancel()
    if not server.started:
        console.print(f"[bold red]cannot serve[/]: the HTTP server could not start on {cfg.server.host}:"
                      f"{cfg.server.port} (see the message above)")
        return 1
    if exit_code["code"] == 1 and ranks is not None:
        console.print(exit_code.get("cause") or ranks.failure_message(), markup=False)
    elif frontend.draining:
        console.print("stopped")
    return exit_code["code"]
