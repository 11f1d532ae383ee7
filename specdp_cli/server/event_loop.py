"""The API server's event loop (`server.event_loop`): uvloop where it is installed ("auto"), as vLLM's and SGLang's
servers run, else asyncio's own. One frontend process's Python sets how many chunks a second a small model's ranks
can be streamed (benchmarks/frontend_bench.py --event-loop); uvloop runs the loop's scheduling and its sockets in C."""
from __future__ import annotations

import asyncio


KINDS = ("auto", "asyncio", "uvloop")        # server.event_loop's values, and `bench serve --event-loop`'s
MISSING = "server.event_loop is uvloop but uvloop is not installed: pip install uvloop, or set server.event_loop: auto"


def installed() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(kind: str) -> str:
    """"auto" -> "uvloop" where it is installed, else "asyncio" (`specdp serve` refuses "uvloop" without it first)."""
    if kind == "asyncio" or (kind == "auto" and not installed()):
        return "asyncio"
    return "uvloop"


def run(coro, kind: str):
    """asyncio.run(coro) on the loop `kind` ("auto", "asyncio", "uvloop")."""
    if resolve(kind) == "uvloop":
        import uvloop
        return uvloop.run(coro)
    return asyncio.run(coro)
