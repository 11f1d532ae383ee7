"""The serving frontend's capacity: `specdp serve`'s HTTP frontend and rank link, with a rank whose
steps cost (almost) nothing, under `specdp bench serve`.

The rank process runs the real serving loop (`server/rank.py`) over a stand-in engine that gives every
running request one token a step, or `--tokens-per-step` as speculative decoding's accepted drafts do
(`--step-ms` of sleep per step, 0 = as fast as the loop goes; `--host-ms` of Python before it, holding the GIL
as a host-bound engine's step does), so
what is measured is everything but the model: HTTP, prompt tokenization, the frontend<->rank link,
detokenization and streaming, and the load generator. It reports the served token rate, the rate the
rank offered, the CPU the frontend process spent per token and the chunks per token the client read.

Usage: python benchmarks/frontend_bench.py [--tokenizer DIR] [--streams 32] [--requests 256]
       [--max-tokens 128] [--step-ms 0] [--tokens-per-step 1] [--host-ms 0] [--rank-cpu N] [--prefix N]
       [--client-workers N] [--profile OUT.prof] [--profile-rank OUT.prof] [--rank-switch-ms MS]
       [--event-loop auto|asyncio|uvloop] [--client-event-loop asyncio|uvloop|auto]
       [--long-prompts N [--long-rate R] [--encode-on-loop]] [--json OUT.json]
"""
import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class InstantEngine:
    """What serve_rank needs of an engine: each step gives every running request `per_step` tokens (a fixed
    id), up to max_tokens, for at most `max_seqs` requests at a time."""

    step_in_flight = False          # its step is over when `step` returns (--async-steps: as if still on the device)

    def __init__(self, max_seqs: int, step_s: float, token: int, per_step: int = 1, host_s: float = 0.0):
        from specdp_cli.runtime.engine import RankCounters

        self.max_seqs, self.step_s, self.token, self.per_step = max_seqs, step_s, token, per_step
        self.host_s = host_s
        self.running, self.waiting = [], []
        self.scheduler = SimpleNamespace(running=self.running, waiting=self.waiting)
        self.pool = SimpleNamespace(num_free=1, num_blocks=1, queries=0, hits=0)
        self.counters = RankCounters()
        self.spec_len = SimpleNamespace(used={0: 0})
        self.fail_stalled = False
        self.step_no = 0
        self.tokens = 0
        self.first = self.last = None

    def stop_followers(self):          # tensor parallelism: none here
        pass

    def make_request(self, req_id, prompt_ids, params, seed, block_hashes=None):
        r = SimpleNamespace(id=req_id, left=params.max_tokens, generated=[])
        r.req = r                   # running, it stands for its sequence too (the loop aborts `seq.req.id` at shutdown)
        # what the serving loop reads of a sequence, made once (the stand-in's own step stays cheap)
        r.seq = SimpleNamespace(req=r, finish_reason=None, error=None, stop_text_end=None, arrived_t=0.0,
                                scheduled_t=0.0, first_token_t=0.0, num_prompt=len(prompt_ids), generated=r.generated,
                                preemptions=0, stats=SimpleNamespace(num_drafts=0, num_draft_tokens=0,
                                                                     num_accepted_tokens=0, accepted_per_pos=[]))
        return r

    def add_request(self, req) -> None:
        self.waiting.append(req)

    def abort(self, req_id) -> bool:
        for q in (self.running, self.waiting):
            for r in q:
                if r.id == req_id:
                    q.remove(r)
                    return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self, received: int = 0, while_device_runs=None):
        while self.waiting and len(self.running) < self.max_seqs:
            self.running.append(self.waiting.pop(0))
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.host_s:      # a host-bound engine's Python, holding the GIL
            pass
        t0 = time.perf_counter()
        if while_device_runs is not None and not self.step_in_flight:   # the last step's tokens go out while the
            while_device_runs()                                          # device runs this one
        if self.step_s:
            time.sleep(max(0.0, self.step_s - (time.perf_counter() - t0)))     # the device's time
        self.step_no += 1
        self.spec_len.used[0] += 1
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now
        outs = []
        for r in list(self.running):
            new = [self.token] * min(self.per_step, r.left)
            r.left -= len(new)
            r.generated += new
            self.tokens += len(new)
            done = r.left == 0
            if done:
                self.running.remove(r)
                r.seq.finish_reason = "length"
            outs.append(SimpleNamespace(seq=r.seq, new_tokens=new, finished=done, logprobs=None))
        return outs


def real_engine(pair: str, method: str, max_seqs: int):
    """`--engine-pair`: offline.py's engine for the pair and method (what its --stdin-rounds process runs), so that a
    profile of the rank (--profile-rank) shows the serving loop's own work around a real engine's steps."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import offline

    a = SimpleNamespace(pair=pair, target=None, dtype="bfloat16", max_model_len=2048, k=4, max_batched_tokens=16384,
                        async_scheduling="auto", gpu_memory_utilization=None)
    engine = offline.build(a, method, False, max_seqs)
    engine.tokens, engine.first, engine.last = 0, None, None
    return engine


def rank_main(link: dict, max_seqs: int, step_s: float, token: int, per_step: int, host_s: float, cpu: int | None,
              result_q, profile: str | None = None, switch_s: float | None = None,
              engine_pair: str | None = None, engine_method: str = "none", async_steps: bool = False) -> None:
    from specdp_cli.server.rank import serve_rank

    if switch_s:
        sys.setswitchinterval(switch_s)

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})

    engine = (real_engine(engine_pair, engine_method, max_seqs) if engine_pair else
              InstantEngine(max_seqs, step_s, token, per_step, host_s))
    if async_steps and not engine_pair:
        engine.step_in_flight = True       # the serving loop sends a step's tokens as soon as it returns
    dp = SimpleNamespace(lockstep=False, rank=0, publish=lambda *a: None)
    if profile:                         # the rank's serving loop, by function (its main thread)
        import cProfile

        cProfile.runctx("serve_rank(engine, dp, {'links': [link]})", globals(), locals(), profile)
    else:
        serve_rank(engine, dp, {"links": [link]})
    span = (engine.last - engine.first) if engine.first else 0.0
    result_q.put({"rank_tokens": engine.tokens, "rank_steps": engine.step_no, "rank_span_s": span})


def rank_seconds(frontend) -> dict[str, float]:
    """The rank's steps, busy seconds and seconds in engine steps so far, as its messages reported them (/metrics,
    rendered here: the frontend's own event loop cannot also answer an HTTP request for them)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from serve_bench import step_counts

    return step_counts(frontend.metrics.render(1).decode())


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def children_cpu_seconds() -> float:
    """CPU of the child processes waited for (the load generator; the rank is still running)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class GCTime:
    """The frontend process's garbage collections by generation: how many, their milliseconds, the longest."""

    def __init__(self):
        import gc

        self.by_gen: dict[int, list] = {}
        self._t = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        ms = 1e3 * (time.perf_counter() - self._t)
        n = self.by_gen.setdefault(info["generation"], [0, 0.0, 0.0])
        n[0], n[1], n[2] = n[0] + 1, n[1] + ms, max(n[2], ms)

    def reset(self) -> None:
        self.by_gen.clear()


def main() -> None:
    from specdp_cli.server import event_loop

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "demo", "pair", "target"))
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--tokens-per-step", type=int, default=1, help="tokens a request gets a step (drafts accepted)")
    ap.add_argument("--rank-cpu", type=int, help="the rank on this CPU alone, the frontend and the client on the "
                    "others (as on a GPU machine with cores to spare)")
    ap.add_argument("--host-ms", type=float, default=0.0,
                    help="Python work a step does before its --step-ms sleep, holding the GIL (a host-bound engine)")
    ap.add_argument("--prefix", type=int, default=0,
                    help="prompts as token ids sharing a PREFIX-token prefix, each with its own 32-token tail "
                         "(serve_bench.py --prefix's shape): a request's own cost in the frontend")
    ap.add_argument("--client-workers", type=int, default=1, help="load-generating processes (bench serve --num-workers)")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave the frontend's start-up heap to the garbage collector (as before the API servers froze it)")
    ap.add_argument("--profile", help="write cProfile's statistics of the frontend's event loop here")
    ap.add_argument("--engine-pair", help="the rank runs offline.py's engine of this pair (codepair layout) instead of "
                    "the stand-in; --tokenizer should be its tokenizer")
    ap.add_argument("--engine-method", default="none", help="--engine-pair's method")
    ap.add_argument("--async-steps", action="store_true",
                    help="the stand-in's steps return with the device still running (async scheduling, as the GPU "
                         "engine's): the loop sends their tokens after the step, not during the next")
    ap.add_argument("--profile-rank", help="write cProfile's statistics of the rank's serving loop here")
    ap.add_argument("--rank-switch-ms", type=float,
                    help="the rank process's GIL switch interval (sys.setswitchinterval; Python's default is 5 ms)")
    ap.add_argument("--event-loop", default="auto", choices=event_loop.KINDS,
                    help="the frontend's event loop (server.event_loop)")
    ap.add_argument("--client-event-loop", default="asyncio", choices=event_loop.KINDS,
                    help="the load generator's (specdp bench serve --event-loop)")
    ap.add_argument("--long-prompts", type=int, default=0,
                    help="beside the load, a second load generator sends text prompts of about this many tokens "
                    "(max_tokens 1, --long-rate a second): what their tokenization costs the streams (ITL)")
    ap.add_argument("--long-rate", type=float, default=4.0)
    ap.add_argument("--encode-on-loop", action="store_true",
                    help="every prompt tokenized on the event loop (as before session 33; app.ENCODE_OFF_LOOP_BYTES)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.rank_cpu is not None:
        os.sched_setaffinity(0, set(os.sched_getaffinity(0)) - {a.rank_cpu})

    import uvicorn

    from specdp_cli.config import SamplingConfig
    from specdp_cli.modeldir import load_tokenizer
    from specdp_cli.prompts import PromptEncoder
    from specdp_cli.server.app import build_app
    from specdp_cli.server.frontend import Frontend
    from specdp_cli.server.link import RankLink, local_link_spec
    from specdp_cli.server.metrics import Metrics
    from specdp_cli.runtime.heap import freeze_startup_heap

    tokenizer = load_tokenizer(a.tokenizer)
    token = tokenizer.encode(" x", add_special_tokens=False)[-1]       # a token that decodes to text
    if a.encode_on_loop:
        from specdp_cli.server import app as app_module
        app_module.ENCODE_OFF_LOOP_BYTES = 1 << 62
    frontend = Frontend(1, Metrics("bench", 1, 4096), 10_000, a.streams)
    link = RankLink(1, local_link_spec(), frontend.on_message, frontend.on_lost)
    frontend.link = link
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rank = ctx.Process(target=rank_main, args=(link.spec, a.streams, a.step_ms / 1000, token, a.tokens_per_step,
                                                a.host_ms / 1000, a.rank_cpu, results, a.profile_rank,
                                                (a.rank_switch_ms or 0) / 1000, a.engine_pair, a.engine_method,
                                                a.async_steps),
                       daemon=True)
    rank.start()
    if not link.wait_connected(300):
        sys.exit("the rank did not connect")
    app = build_app(frontend, PromptEncoder(tokenizer), tokenizer, "bench", 4096, SamplingConfig(), None)
    if not a.no_freeze:
        freeze_startup_heap()                 # as `specdp serve`'s API servers do once started
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=a.port, log_level="warning", lifespan="off"))
    measured = {}
    gc_time = GCTime()

    async def serve() -> None:
        link.attach(asyncio.get_running_loop())
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        out = os.path.join(tempfile.mkdtemp(), "bench.json")
        client_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}

        def bench_serve(streams, prompts, max_tokens, result, *more) -> list[str]:      # a load generator's command
            return [sys.executable, "-m", "specdp_cli", "bench", "serve", "--url", f"http://127.0.0.1:{a.port}",
                    "--max-concurrency", str(streams), "--num-prompts", str(prompts), "--max-tokens", str(max_tokens),
                    "--result-filename", result, *more]

        cmd = bench_serve(a.streams, a.requests, a.max_tokens, out, "--num-workers", str(a.client_workers),
                          "--event-loop", a.client_event_loop)
        if a.prefix:
            ids = [token] * a.prefix
            path = os.path.join(os.path.dirname(out), "prompts.jsonl")
            with open(path, "w") as fh:
                for i in range(a.requests):
                    fh.write(json.dumps({"prompt": ids + [(i * 32 + j) % 1000 + 10 for j in range(32)]}) + "\n")
            cmd += ["--input", path]
        long_proc = None
        if a.long_prompts:                    # long text prompts beside the load (their own load generator)
            piece = open(os.path.join(ROOT, "specdp_cli", "runtime", "engine.py")).read()
            text = piece * max(1, -(-a.long_prompts // len(tokenizer(piece)["input_ids"])))
            text = tokenizer.decode(tokenizer(text)["input_ids"][:a.long_prompts])
            long_path = os.path.join(os.path.dirname(out), "long.jsonl")
            with open(long_path, "w") as fh:
                fh.write(json.dumps({"prompt": text}) + "\n")
            long_cmd = bench_serve(2, 100000, 1, out + ".long.json", "--request-rate", str(a.long_rate),
                                   "--input", long_path)
            long_proc = await asyncio.create_subprocess_exec(*long_cmd, stdout=subprocess.DEVNULL,
                                                             stderr=subprocess.DEVNULL, env=client_env)
        gc_time.reset()
        rank0 = rank_seconds(frontend)
        c0, t0, k0 = cpu_seconds(), time.perf_counter(), children_cpu_seconds()
        measured["client_t0"] = time.time()
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.DEVNULL, env=client_env)
        await proc.wait()
        if long_proc is not None:
            long_proc.kill()
            await long_proc.wait()
        measured["client_t1"] = time.time()
        measured.update(frontend_cpu_s=cpu_seconds() - c0, wall_s=time.perf_counter() - t0,
                        client_cpu_s=children_cpu_seconds() - k0,
                        gc={g: {"collections": n, "ms": round(ms, 2), "longest_ms": round(mx, 2)}
                            for g, (n, ms, mx) in sorted(gc_time.by_gen.items())})
        measured["bench"] = json.load(open(out))
        rank1 = rank_seconds(frontend)
        measured["rank"] = {k: rank1[k] - rank0[k] for k in rank0}
        server.should_exit = True
        await task

    if a.profile:                             # the frontend's own time (its event loop), by function
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(event_loop.run, serve(), a.event_loop)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        prof.dump_stats(a.profile)
    else:
        event_loop.run(serve(), a.event_loop)
    link.send(0, ("shutdown",))
    r = results.get(timeout=30)
    rank.join(10)
    b = measured["bench"]
    tokens = b["total_output_tokens"]
    res = {"event_loop": event_loop.resolve(a.event_loop), "streams": a.streams, "requests": a.requests,
           "prefix": a.prefix, "max_tokens": a.max_tokens,
           "step_ms": a.step_ms,
           "host_ms": a.host_ms,
           "tokens_per_step": a.tokens_per_step, "rank_steps": r["rank_steps"],
           "rank_ms_per_step": 1e3 * r["rank_span_s"] / max(r["rank_steps"], 1),
           "served_tok_s": b["output_throughput"], "rank_offered_tok_s": r["rank_tokens"] / max(r["rank_span_s"], 1e-9),
           "frontend_cpu_us_per_token": 1e6 * measured["frontend_cpu_s"] / max(tokens, 1),
           "client_cpu_us_per_token": 1e6 * measured["client_cpu_s"] / max(tokens, 1),
           "frontend_cpu_us_per_request": 1e6 * measured["frontend_cpu_s"] / max(b["completed"], 1),
           "frontend_cpu_share": measured["frontend_cpu_s"] / b["duration_s"], "client_workers": a.client_workers,
           "ttft_ms_median": b["ttft_ms"]["median"], "ttft_ms_mean": b["ttft_ms"]["mean"],
           "server_ttft_ms_mean": b.get("server_ttft_ms"), "itl_ms_median": b["itl_ms"]["median"],
           "itl_ms_p99": b["itl_ms"]["p99"], "itl_ms_max": b["itl_ms"].get("max"), "failed": b["failed"],
           "tokens": tokens, "long_prompts": a.long_prompts, "long_rate": a.long_rate,
           "encode_on_loop": a.encode_on_loop,
           "frontend_gc": measured["gc"],
           # the serving loop's own time a step: the rank's busy time outside its engine steps
           "rank_loop_us_per_step": 1e6 * (measured["rank"]["busy_s"] - measured["rank"]["step_s"])
           / max(measured["rank"]["steps"], 1),
           "client_t0": measured["client_t0"], "client_t1": measured["client_t1"]}     # (wall clock: what ran beside it)
    print(f"{'streams':>8} {'served tok/s':>13} {'rank tok/s':>11} {'frontend us/tok':>16} {'client us/tok':>14} "
          f"{'TTFT ms':>8} {'ITL p50':>8} {'ITL p99':>8} {'rank ms/step':>13} {'frontend us/req':>16} {'frontend CPU':>13}")
    print(f"{a.streams:>8} {res['served_tok_s']:>13,.0f} {res['rank_offered_tok_s']:>11,.0f} "
          f"{res['frontend_cpu_us_per_token']:>16.1f} {res['client_cpu_us_per_token']:>14.1f} "
          f"{res['ttft_ms_median']:>8.1f} {res['itl_ms_median']:>8.2f} {res['itl_ms_p99']:>8.2f} "
          f"{res['rank_ms_per_step']:>13.3f} {res['frontend_cpu_us_per_request']:>16.0f} {res['frontend_cpu_share']:>13.0%}")
    print(f"rank: {res['rank_loop_us_per_step']:.1f} us a step in the serving loop outside engine steps")
    if a.long_prompts:
        print(f"with {a.long_prompts}-token text prompts beside (about {a.long_rate:g} a second, tokenized "
              f"{'on the event loop' if a.encode_on_loop else 'as shipped'}): ITL max {res['itl_ms_max']:.1f} ms")
    print("frontend garbage collections over the run, by generation:", ", ".join(
        f"{g}: {v['collections']} in {v['ms']:.1f} ms (longest {v['longest_ms']:.1f})" for g, v in res["frontend_gc"].items()))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
