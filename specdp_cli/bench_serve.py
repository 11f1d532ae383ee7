"""`specdp bench serve`: a load generator for any OpenAI-compatible server, reporting what
`vllm bench serve` reports, with its definitions:

  TTFT  time from sending a request to its first streamed token
  TPOT  (latency - TTFT) / (output tokens - 1), per request (the first token excluded)
  ITL   the time between consecutive streamed chunks, over all requests
  throughput: requests, output tokens and (prompt + output) tokens per second of the whole run

Against a specdp server it also reads /metrics before and after, for the acceptance rate and the
mean acceptance length of the run, and the ranks' mean queue, prefill and decode times of a request (what
of TTFT the engine took; the rest is HTTP, the frontend and the link), and the mean TTFT the frontend measured.
Requests go out on one asyncio event loop (or uvloop's: `--event-loop`) over keep-alive HTTP/1.1 connections (the
standard library's streams; as `vllm bench serve` uses aiohttp): the load generator's own cost stays small next to
the server's, and no thread waits for the GIL between a token's arrival and its timestamp. On uvloop the load
generator's CPU a token was within the runs' scatter of asyncio's (benchmarks/frontend_bench.py
--client-event-loop), and against a served H200 rank it measured the same throughput with higher TTFT and
inter-token latency (docs/benchmarks.md, session 35): asyncio's stays the default, as in `vllm bench serve`.
`--num-workers N` runs N such loops in processes of their own, for a server that one loop cannot keep up with.
"""
from __future__ import annotations

import asyncio
import gc
import http.client
import json
import queue
import random
import ssl
import statistics
import time
from urllib.parse import urlparse

from rich.console import Console
from rich.table import Table

from .server import event_loop
from .server.metrics import parse_prometheus

BUILTIN_PROMPTS = [
    "def fibonacci(n):\n", "import json\n\n\ndef load(path):\n", "class Stack:\n    def __init__(self):\n",
    "for key, value in sorted(data.items()):\n", "def parse_args(argv=None):\n    parser = ",
    "try:\n    import numpy as np\nexcept ImportError:\n", "async def fetch(session, url):\n",
    "with open(filename) as fh:\n    for line in fh:\n",
]


REQUEST_TIMEOUT_S = 600


class BenchError(Exception):
    pass


class _Client:
    def __init__(self, url: str, api_key: str | None):
        u = urlparse(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise BenchError(f"--url must look like http://HOST:PORT (got {url!r})")
        self.https = u.scheme == "https"
        self.host, self.port = u.hostname, u.port or (443 if self.https else 80)
        self.base = u.path.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def conn(self, timeout: float = 600):
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)

    def get(self, path: str) -> tuple[int, str]:
        c = self.conn(30)
        try:
            c.request("GET", self.base + path, headers=self.headers)
            r = c.getresponse()
            return r.status, r.read().decode(errors="replace")
        finally:
            c.close()


def _prompts(path: str | None) -> list:
    if path is None:
        return BUILTIN_PROMPTS
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            if path.endswith((".jsonl", ".json")):
                obj = json.loads(line)
                prompt = obj.get("prompt") if isinstance(obj, dict) else None
                # a string, or token ids (as the completions API takes them: the server's tokens exactly)
                if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                               and all(isinstance(t, int) for t in prompt)):
                    out.append(prompt)
            else:
                out.append(line.rstrip("\n"))
    if not out:
        raise BenchError(f"no prompts found in {path}")
    return out


class _Conn:
    """One keep-alive HTTP/1.1 connection: a request, then its (chunked or sized) response, in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, client: _Client) -> "_Conn":
        ctx = ssl.create_default_context() if client.https else None
        return cls(*await asyncio.open_connection(client.host, client.port, ssl=ctx))

    def close(self) -> None:
        self.writer.close()

    async def post(self, client: _Client, path: str, body: bytes) -> tuple[int, dict]:
        head = [f"POST {path} HTTP/1.1", f"Host: {client.host}:{client.port}", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in client.headers.items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, headers

    async def body(self, headers: dict):
        """The response body's pieces as they arrive (chunked transfer or Content-Length)."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()
                    return
                data = await self.reader.readexactly(size + 2)
                yield data[:-2]
        else:
            yield await self.reader.readexactly(int(headers.get("content-length", 0)))


def _result(error: str | None = None) -> dict:
    """One request's record, before anything arrived (or failed with `error`)."""
    return {"ok": False, "ttft": None, "latency": None, "itl": [], "output_tokens": 0, "prompt_tokens": 0,
            "error": error}


async def _one(client: _Client, pool: list, model: str, prompt, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    res = _result()
    conn = None
    reusable = False
    t0 = time.perf_counter()
    try:
        conn = pool.pop() if pool else await _Conn.open(client)
        status, headers = await conn.post(client, client.base + "/v1/completions", body)
        reusable = headers.get("connection", "").lower() != "close"
        if status != 200:
            text = b"".join([piece async for piece in conn.body(headers)])
            res["error"] = f"HTTP {status}: {text[:300].decode(errors='replace')}"
            return res
        last, buf, done = None, b"", False
        async for piece in conn.body(headers):
            if done:
                continue                     # read to the end of the response, so the connection can serve again
            buf += piece
            *events, buf = buf.split(b"\n\n")
            for event in events:
                line = event.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res["error"] = obj["error"].get("message")
                    done = True
                    break
                if obj.get("usage"):
                    res["output_tokens"] = obj["usage"]["completion_tokens"]
                    res["prompt_tokens"] = obj["usage"]["prompt_tokens"]
                if any(ch.get("text") for ch in obj.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        res["ttft"] = now - t0
                    else:
                        res["itl"].append(now - last)
                    last = now
        res["latency"] = time.perf_counter() - t0
        res["ok"] = res["error"] is None
    except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
        reusable = False
    finally:
        if conn is not None:
            if reusable:
                pool.append(conn)
            else:
                conn.close()
    return res


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None, "max": None}
    v = sorted(values)
    p99 = v[min(len(v) - 1, max(0, int(round(0.99 * len(v) + 0.5)) - 1))]
    return {"mean": 1000 * statistics.fmean(v), "median": 1000 * statistics.median(v), "p99": 1000 * p99,
            "max": 1000 * v[-1]}


SPEC_COUNTERS = {"drafts": "specdp:spec_decode_num_drafts_total",
                 "draft_tokens": "specdp:spec_decode_num_draft_tokens_total",
                 "accepted": "specdp:spec_decode_num_accepted_tokens_total"}
# the ranks' side of a request's time (summed over requests; with _count, a mean)
PHASES = {"queue": "specdp:request_queue_time_seconds", "prefill": "specdp:request_prefill_time_seconds",
          "decode": "specdp:request_decode_time_seconds",
          # the frontend's: from a request's arrival (its body parsed) to its handler taking the first token
          "ttft": "specdp:time_to_first_token_seconds"}


def _server_counters(client: _Client) -> dict | None:
    """A specdp server's spec-decode counters and request phase sums and counts, summed over its ranks (None
    for another server)."""
    try:
        status, text = client.get("/metrics")
    except OSError:
        return None
    if status != 200:
        return None
    m = parse_prometheus(text)
    wanted = {**SPEC_COUNTERS, **{f"{k}_sum": v + "_sum" for k, v in PHASES.items()},
              **{f"{k}_count": v + "_count" for k, v in PHASES.items()}}
    out = {}
    for name, metric in wanted.items():
        vals = [v for k, v in m.items() if k.split("{")[0] == metric]
        if not vals:
            return None
        out[name] = sum(vals)
    return out


def _freeze_heap() -> None:
    """What the load generator's process holds before the run, out of the garbage collector's view: a full
    collection then walks only the run's objects, and stalls the timestamps less (the server does the same)."""
    gc.collect()
    gc.freeze()


class _Counter:
    """The next request index of a run for one process: start, start + step, ... below num_requests."""

    def __init__(self, num_requests: int, start: int = 0, step: int = 1):
        self.next, self.step, self.total = start, step, num_requests

    def claim(self) -> int | None:
        if self.next >= self.total:
            return None
        self.next += self.step
        return self.next - self.step


class _SharedCounter:
    """The next request index of a run, shared by the load-generating processes: a stream that frees up takes
    the run's next request, whichever process it is in, as one process's streams would. (Fixed shares, request i
    in process i % N, left a process whose requests ran long finishing alone at the run's end.)"""

    def __init__(self, value, num_requests: int):
        self.value, self.total = value, num_requests

    def claim(self) -> int | None:
        with self.value.get_lock():
            i = self.value.value
            if i >= self.total:
                return None
            self.value.value = i + 1
        return i


async def _send_all(client: _Client, model: str, prompts: list, counter, max_tokens: int,
                    concurrency: int | None, request_rate: float, seed: int) -> list[dict]:
    """The requests `counter.claim()` hands out (request i takes prompt i) at their arrival times (a Poisson
    process of request_rate; inf: each as soon as a stream is free), at most `concurrency` in flight, over a pool
    of idle keep-alive connections."""
    pool: list[_Conn] = []
    rng = random.Random(seed)

    async def one(i: int) -> dict:
        try:
            return await asyncio.wait_for(_one(client, pool, model, prompts[i % len(prompts)], max_tokens),
                                          REQUEST_TIMEOUT_S)
        except TimeoutError:
            return _result(f"no answer within {REQUEST_TIMEOUT_S} s")

    results: list[dict] = []
    if request_rate == float("inf") and concurrency:
        async def stream() -> None:                   # closed loop: a request claimed when the last one ends
            while (i := counter.claim()) is not None:
                results.append(await one(i))

        await asyncio.gather(*(stream() for _ in range(concurrency)))
    else:
        limit = asyncio.Semaphore(concurrency) if concurrency else None

        async def task(i: int) -> None:
            if limit is None:
                results.append(await one(i))
                return
            async with limit:
                results.append(await one(i))

        tasks = []
        while (i := counter.claim()) is not None:      # a request claimed when it arrives
            tasks.append(asyncio.create_task(task(i)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))      # the arrival process itself
        await asyncio.gather(*tasks)
    for conn in pool:
        conn.close()
    return results


def _worker(client: _Client, model: str, prompts: list, counter, max_tokens: int, concurrency: int | None,
            request_rate: float, seed: int, loop: str, go, out) -> None:
    """One load-generating process of --num-workers: its share of the streams and rate, its requests from
    `counter` (the run's shared one, or its fixed share for requests all sent at once). It says it is ready
    (imports done) and starts when every process is."""
    _freeze_heap()
    out.put("ready")
    go.wait()
    t0 = time.perf_counter()          # CLOCK_MONOTONIC: comparable between the processes
    results = event_loop.run(_send_all(client, model, prompts, counter, max_tokens, concurrency, request_rate, seed),
                             loop)
    out.put((t0, time.perf_counter(), results))


def _send_in_processes(client: _Client, model: str, prompts: list, num_requests: int, max_tokens: int,
                       concurrency: int | None, request_rate: float, seed: int, workers: int,
                       loop: str) -> tuple[list, float]:
    """The requests over `workers` processes (each its own event loop), the streams and the arrival rate split
    evenly, the requests claimed in turn from one counter (all sent at once: every N-th in each process). The
    processes start together once all have started up, so the run does not time one process's start-up while
    another already sends. Returns the results and the run's duration (first start to last end)."""
    if workers == 1:
        _freeze_heap()
        t0 = time.perf_counter()
        results = event_loop.run(_send_all(client, model, prompts, _Counter(num_requests), max_tokens, concurrency,
                                           request_rate, seed), loop)
        return results, time.perf_counter() - t0
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    shared = _SharedCounter(ctx.Value("q", 0), num_requests)
    all_at_once = concurrency is None and request_rate == float("inf")     # nothing to claim in turn: fixed shares
    procs = []
    for w in range(workers):
        share = None if concurrency is None else concurrency // workers + (w < concurrency % workers)
        counter = _Counter(num_requests, w, workers) if all_at_once else shared
        procs.append(ctx.Process(target=_worker, daemon=True, args=(
            client, model, prompts, counter, max_tokens, share, request_rate / workers, seed + w, loop, go, out)))
    for p in procs:
        p.start()

    def gather(n: int) -> list:
        got = []
        while len(got) < n:
            try:
                got.append(out.get(timeout=1.0))
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    for p in procs:
                        p.kill()
                    raise BenchError(f"a load-generating process failed (exit status {failed[0]})") from None
        return got

    gather(workers)                 # every process ready
    go.set()
    parts = gather(workers)
    for p in procs:
        p.join()
    results = [r for _, _, rs in parts for r in rs]
    return results, max(end for _, end, _ in parts) - min(start for start, _, _ in parts)


def run_bench(url: str, input_path: str | None, concurrency: int | None, num_requests: int, max_tokens: int,
              model: str | None, api_key: str | None, request_rate: float = float("inf"), seed: int = 0,
              workers: int = 1, loop: str = "asyncio") -> dict:
    """Send num_requests requests as `vllm bench serve` does: arrivals a Poisson process of
    `request_rate` per second (inf: all at once), at most `concurrency` in flight (None: no limit),
    from `workers` processes (more than one when a single load generator would be the bottleneck), each on the
    event loop `loop` (server/event_loop.py's names: asyncio, uvloop, or auto, uvloop where installed)."""
    if concurrency is not None and workers > concurrency:
        raise BenchError(f"--num-workers {workers} is more than --max-concurrency {concurrency}: each worker "
                         f"needs at least one stream")
    workers = min(workers, num_requests)
    client = _Client(url, api_key)
    try:
        status, text = client.get("/v1/models")
    except OSError as e:
        raise BenchError(f"cannot reach {url}: {e}") from None
    if status != 200:
        raise BenchError(f"GET /v1/models answered {status}: {text[:200]}")
    if model is None:
        data = json.loads(text).get("data") or []
        if not data:
            raise BenchError("the server lists no model")
        model = data[0]["id"]
    prompts = _prompts(input_path)
    before = _server_counters(client)
    results, duration = _send_in_processes(client, model, prompts, num_requests, max_tokens, concurrency,
                                           request_rate, seed, workers, loop)
    after = _server_counters(client)
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok
            if r["ttft"] is not None and r["output_tokens"] > 1]
    res = {
        "url": url, "model": model, "max_concurrency": concurrency, "request_rate": request_rate,
        "num_workers": workers, "event_loop": event_loop.resolve(loop),
        "num_prompts": num_requests, "max_tokens": max_tokens,
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": _stats_ms([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_ms": _stats_ms(tpot), "itl_ms": _stats_ms([x for r in ok for x in r["itl"]]),
        "acceptance_rate": None, "mean_acceptance_length": None,
        "server_queue_ms": None, "server_prefill_ms": None, "server_decode_ms": None, "server_ttft_ms": None,
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
    }
    if before and after:
        d = {k: after[k] - before[k] for k in before}
        if d["draft_tokens"] > 0:
            res["acceptance_rate"] = d["accepted"] / d["draft_tokens"]
        if d["drafts"] > 0:
            res["mean_acceptance_length"] = 1 + d["accepted"] / d["drafts"]
        for k in PHASES:
            if d[f"{k}_count"] > 0:
                res[f"server_{k}_ms"] = 1000 * d[f"{k}_sum"] / d[f"{k}_count"]
    return res


def print_results(res: dict, console: Console) -> None:
    t = Table(title=f"specdp bench serve — {res['model']} @ {res['url']}", show_header=False)
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    rows = [("successful requests", str(res["completed"])), ("failed requests", str(res["failed"])),
            ("maximum request concurrency", str(res["max_concurrency"] or "-")),
            ("request rate (req/s)", str(res["request_rate"])), ("benchmark duration (s)", f(res["duration_s"])),
            ("total input tokens", str(res["total_input_tokens"])), ("total generated tokens", str(res["total_output_tokens"])),
            ("request throughput (req/s)", f(res["request_throughput"])),
            ("output token throughput (tok/s)", f(res["output_throughput"])),
            ("total token throughput (tok/s)", f(res["total_token_throughput"]))]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat} {name} (ms)", f(res[key][stat])))
    rows += [("acceptance rate", f(res["acceptance_rate"], "{:.3f}")),
             ("mean acceptance length", f(res["mean_acceptance_length"], "{:.3f}")),
             ("server: mean queue time (ms)", f(res["server_queue_ms"])),
             ("server: mean prefill time (ms)", f(res["server_prefill_ms"])),
             ("server: mean decode time (ms)", f(res["server_decode_ms"])),
             ("server: mean TTFT in the frontend (ms)", f(res["server_ttft_ms"]))]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    for e in res["errors"]:
        console.print(f"error: {e}", markup=False)
