"""Served against offline: `specdp serve` under `specdp bench serve` (N requests, C streams), and the same
engine config and prompts offline (`benchmarks/offline.py`, C sequences in the batch), per method.

Two workloads:
  - default: the pair's held-out prompts cut at 4 points (`workloads.cut_prompt_ids`), as offline.py's
    `--requests N` takes them; each row has served and offline tok/s and their ratio;
  - `--prefix P`: every request shares a P-token prefix (the held-out text, repeated) and has its own tail,
    served with prefix caching on and off (`--caching on,off`): TTFT and throughput with and without it.
Prompts go to the server as token ids, so both sides see the same tokens. Each side is measured `--rounds` times
(offline: one engine; served: one server) and the median reported: a 256-request run lasts about a second, and
single offline runs of one method differed by up to 40 % between machines. `--processes N` alternates N offline
processes and N servers per method and takes the median over all their rounds (on the H200 machines two processes
of one side ran up to 2x apart on the same machine).

`--interleave` makes the sides take turns, round by round: one offline process beside the server runs before each
served round, and with `--caching on,off` both servers are up at once, a round each in turn. The machines' speed
changes over seconds (a Python loop ran 2x apart from one second to the next on one CPU): sides measured one after
the other each catch their own speed, so a row then also has the median of the rounds' pair ratios (each served round
over the offline run just before it; caching on over the off round just before it).

Usage: python benchmarks/serve_bench.py --pair PAIR_DIR [--target DIR] [--methods none,draft_model,eagle]
       [--requests 256] [--concurrency 32] [--max-tokens 128] [--dp 1] [--prefix 0] [--caching on]
       [--dtype bfloat16] [--client-workers 1,2] [--client-event-loop asyncio] [--rounds 3] [--processes 1]
       [--api-servers 1] [--no-offline] [--interleave] [--rank-cpu N] [--rank-threads N] --work DIR --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from specdp_cli.bench_serve import run_bench  # noqa: E402
from specdp_cli.methods import METHODS  # noqa: E402
from specdp_cli.server import event_loop  # noqa: E402

from workloads import cut_prompt_ids, heldout  # noqa: E402


def prefix_prompts(pair: str, prefix: int, n: int) -> list[list[int]]:
    """A shared `prefix`-token prefix (the held-out prompts' text, repeated as needed), then a tail each."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "tokenizer"))
    texts = heldout(pair)
    ids: list[int] = tok("\n".join(texts))["input_ids"]
    while len(ids) < prefix:
        ids += ids
    return [ids[:prefix] + tok.encode(f"\n# request {i}: {texts[i % len(texts)][:60]}", add_special_tokens=False)
            for i in range(n)]


def config(a, method: str, caching: bool) -> dict:
    """The engine config offline.py builds for `method`, served."""
    spec = {"method": method, "num_speculative_tokens": a.k}
    if METHODS[method].loads:
        spec["model"] = os.path.join(a.pair, method if method.startswith("eagle") else "draft")
    return {"model": a.target or os.path.join(a.pair, "target"), "tokenizer": os.path.join(a.pair, "tokenizer"),
            "dtype": a.dtype, "max_model_len": a.max_model_len, "speculative": spec,
            "parallel": {"data_parallel_size": a.dp},
            "scheduler": {"max_num_seqs": a.concurrency, "max_num_batched_tokens": 16384},
            "cache": {"enable_prefix_caching": caching},
            "server": {"port": a.port, "model_name": "bench", "api_server_count": a.api_servers}}


def offline(a, method: str, proc: int) -> list[dict]:
    """`--rounds` offline runs (one process, one engine), each run's row; [] when the process failed."""
    out = os.path.join(a.work, f"offline_{method}_p{proc}.json")
    cmd = [sys.executable, os.path.join(HERE, "offline.py"), "--pair", a.pair, "--requests", str(a.requests),
           "--batches", ",".join([str(a.concurrency)] * a.rounds), "--methods", method, "--k", str(a.k), "--new", str(a.max_tokens),
           "--max-model-len", str(a.max_model_len), "--dtype", a.dtype, "--json", out]
    cmd += ["--target", a.target] if a.target else []
    with open(os.path.join(a.work, f"offline_{method}_p{proc}.log"), "w") as log:
        cpu = None if a.rank_cpu is None else (lambda: os.sched_setaffinity(0, {a.rank_cpu}))
        if subprocess.run(cmd, stdout=log, stderr=log, preexec_fn=cpu, env=process_env(a)).returncode != 0:
            print(f"offline {method} failed: see {log.name}")
            return []
    return json.load(open(out))["rows"]


STEP_COUNTS = {"steps": "specdp:spec_decode_steps_by_k_total", "planned_ahead": "specdp:steps_planned_ahead_total",
               "chunk_steps": "specdp:steps_with_prompt_chunks_total", "busy_s": "specdp:rank_busy_seconds_total",
               "step_s": "specdp:rank_step_seconds_total", "prefix_queries": "specdp:prefix_cache_queries_total",
               "prefix_hits": "specdp:prefix_cache_hits_total", "gc_collections": "specdp:rank_gc_collections_total",
               "gc_pause_s": "specdp:rank_gc_pause_seconds_total"}


def process_env(a) -> dict[str, str]:
    """The server's and the offline process's environment: --rank-threads sets OMP_NUM_THREADS, which a GPU rank's
    intra-op threads follow (launch.threads_per_rank), as offline.py's engine does."""
    return dict(os.environ, **({"OMP_NUM_THREADS": str(a.rank_threads)} if a.rank_threads else {}))


def step_counts(metrics_text: str) -> dict[str, float]:
    """STEP_COUNTS of /metrics' text, each summed over the ranks."""
    lines = metrics_text.splitlines()
    return {key: sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))
            for key, name in STEP_COUNTS.items()}


def steps_so_far(url: str) -> dict[str, float]:
    """The server's ranks' engine steps so far (the sum of /metrics' steps per k), of them those planned ahead
    and those with prompt chunks, the seconds they were busy (not waiting for requests) and in engine steps, and
    their prefix cache's queries and hits."""
    return step_counts(urllib.request.urlopen(url + "/metrics", timeout=5).read().decode())


def core_of(cpu: int) -> list[int]:
    """`cpu` and its hyperthread siblings (the CPUs of its physical core), as Linux lists them."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as fh:
            text = fh.read().strip()
    except OSError:
        return [cpu]
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` on `cpus` (sched_setaffinity takes one thread at a time)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass                  # a thread that has ended


CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
TICK = os.sysconf("SC_CLK_TCK")


def stat_fields(path: str) -> list[str]:
    """/proc/PID/stat (or a thread's /proc/PID/task/TID/stat) past the command's name: [state, ppid, ...]."""
    with open(path) as fh:
        return fh.read().rsplit(")", 1)[1].split()


def cpu_s(path: str) -> float:
    """A process's (all its threads) or a thread's CPU seconds so far, user + system, from its stat file."""
    f = stat_fields(path)
    return (int(f[11]) + int(f[12])) / TICK


def cpu_account(cpu: int | None, pid: int | None) -> dict[str, float]:
    """Counters of where the rank CPU's time went (/proc/stat: user, system, irq, softirq, steal, ... seconds), its
    interrupts (/proc/interrupts), and the process's CPU seconds and context switches (/proc/PID/stat and status):
    a round's difference says whether the process ran alone on its CPU, was preempted, or lost time to the
    hypervisor (steal) or to interrupt work. {} without --rank-cpu."""
    if cpu is None:
        return {}
    out: dict[str, float] = {}
    try:
        with open("/proc/stat") as fh:
            for line in fh:
                if line.startswith(f"cpu{cpu} "):
                    out.update({f"cpu_{k}": int(v) / TICK for k, v in zip(CPU_FIELDS, line.split()[1:])})
        with open("/proc/interrupts") as fh:
            cpus = fh.readline().split()
            col = cpus.index(f"CPU{cpu}")
            out["interrupts"] = sum(int(f[col + 1]) for f in (line.split() for line in fh)
                                    if len(f) > col + 1 and f[col + 1].isdigit())
        if pid is not None:
            f = stat_fields(f"/proc/{pid}/stat")
            out["proc_utime"], out["proc_stime"] = int(f[11]) / TICK, int(f[12]) / TICK
            with open(f"/proc/{pid}/status") as fh:       # the main thread's
                for line in fh:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        out[line.split(":")[0]] = int(line.split()[1])
            out["threads_other_s"] = 0.0                   # the CPU seconds of the process's other threads
            for tid in os.listdir(f"/proc/{pid}/task"):
                if int(tid) != pid:
                    try:
                        out["threads_other_s"] += cpu_s(f"/proc/{pid}/task/{tid}/stat")
                    except OSError:
                        pass                               # a thread that has ended
    except (OSError, ValueError, IndexError):
        pass
    return out


def account_delta(before: dict, after: dict) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


def per_step(rounds: list[dict], steps_key: str) -> dict[str, float] | None:
    """The rounds' median of each CPU counter a step (seconds -> microseconds; counts stay counts)."""
    accts = [(r["cpu_account"], r[steps_key]) for r in rounds if r.get("cpu_account")]
    if not accts:
        return None
    keys = set.intersection(*(set(a) for a, _ in accts))
    scale = {k: 1e6 if k.startswith(("cpu_", "proc_", "threads_")) else 1 for k in keys}
    return {k: statistics.median(a[k] * scale[k] / max(n, 1) for a, n in accts) for k in sorted(keys)}


def processes_cpu_s(pids) -> float:
    """The CPU seconds (user + system, all threads) the processes have used so far (ended ones left out)."""
    total = 0.0
    for pid in pids:
        try:
            total += cpu_s(f"/proc/{pid}/stat")
        except OSError:
            pass
    return total


def server_processes(server_pid: int) -> tuple[list[int], list[int]]:
    """(its ranks (`specdp_cli.rank`), every other process of the server: the command, the API server processes,
    the launcher) under a server, from one pass over /proc."""
    parent, is_rank = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            parent[int(name)] = int(stat_fields(f"/proc/{name}/stat")[1])
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                is_rank[int(name)] = b"specdp_cli.rank" in fh.read()
        except (OSError, ValueError, IndexError):
            pass
    tree, todo = [], [server_pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        tree += kids
        todo += kids
    return [p for p in tree if is_rank.get(p)], [server_pid] + [p for p in tree if not is_rank.get(p)]


def start_offline_rounds(args: list[str], log=None, env: dict | None = None, preexec_fn=None,
                         pin_cpu: int | None = None) -> subprocess.Popen:
    """An `offline.py --stdin-rounds` process (ARGS after the script), started and warmed up: `offline_round` runs
    one round of it. Its stderr goes to `log`; `pin_cpu`: every thread of it moved to that CPU once started."""
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "offline.py"), *args, "--stdin-rounds",
                             "--json", os.devnull], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                            text=True, env=env, preexec_fn=preexec_fn)
    if pin_cpu is not None:
        pin(proc.pid, {pin_cpu})
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise SystemExit(f"offline.py {' '.join(args)} failed" + (f": see {log.name}" if hasattr(log, "name") else ""))


def offline_round(proc: subprocess.Popen) -> dict:
    """One run of every prompt by an `offline.py --stdin-rounds` process: its figures."""
    proc.stdin.write("run\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


class OfflineRounds:
    """`--interleave`: one offline process (offline.py --stdin-rounds) kept beside the server, a run of it before each
    served round, so that both sides' rounds take turns on the machine (its speed changes over seconds: sides
    measured one after the other may each catch another speed). Started at the first round, after the server (which
    then holds its share of the GPU's memory, `Server`'s `memory`: the offline engine sizes its KV cache from what is
    left)."""

    def __init__(self, a, method: str):
        self.a, self.method, self.proc, self.rows = a, method, None, []

    def run_round(self) -> None:
        a = self.a
        if self.proc is None:
            args = ["--pair", a.pair, "--requests", str(a.requests), "--batches", str(a.concurrency), "--methods",
                    self.method, "--k", str(a.k), "--new", str(a.max_tokens), "--max-model-len", str(a.max_model_len),
                    "--dtype", a.dtype] + (["--target", a.target] if a.target else [])
            log = open(os.path.join(a.work, f"offline_{self.method}_interleaved.log"), "w")
            self.proc = start_offline_rounds(args, log, process_env(a), pin_cpu=a.rank_cpu)
        before = cpu_account(a.rank_cpu, self.proc.pid)
        row = offline_round(self.proc)
        row["cpu_account"] = account_delta(before, cpu_account(a.rank_cpu, self.proc.pid))
        self.rows.append(row)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(60)


class Server:
    """One `specdp serve` (method, caching) on `port`: started, warmed up, measured round by round, stopped.
    `memory`: its `gpu_memory_utilization` when engines share the GPU (--interleave; each one's KV cache is sized from
    that share of the whole minus what is in use when it starts)."""

    def __init__(self, a, method: str, caching: bool, prompts_path: str, tag: str, port: int, memory: float | None):
        self.a, self.tag, self.prompts_path = a, tag, prompts_path
        cfg = config(a, method, caching)
        cfg["server"]["port"] = port
        if memory is not None:
            cfg["cache"]["gpu_memory_utilization"] = memory
        cfg_path = os.path.join(a.work, f"serve_{tag}.yaml")
        with open(cfg_path, "w") as fh:
            yaml.safe_dump(cfg, fh)
        self.log = open(os.path.join(a.work, f"server_{tag}.log"), "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "specdp_cli", "serve", cfg_path], env=process_env(a),
                                     stdout=self.log, stderr=self.log)
        self.url = f"http://127.0.0.1:{port}"
        self.rank_pid = None        # with --rank-cpu and one rank: its pid (cpu_account)
        self.frontend_pids: list[int] = []      # the server's processes but its ranks (their CPU a round)

    def wait_ready(self) -> None:
        deadline = time.time() + 300
        while True:
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"server did not come up: see {self.log.name}")
            time.sleep(0.5)
        ranks, self.frontend_pids = server_processes(self.proc.pid)
        if self.a.rank_cpu is not None:
            if not ranks:
                raise SystemExit(f"--rank-cpu: no rank process found under the server (pid {self.proc.pid})")
            for pid in ranks:
                pin(pid, {self.a.rank_cpu})
            self.rank_pid = ranks[0] if len(ranks) == 1 else None
        self.bench(self.a.concurrency, 1)   # a warm-up round (first requests of each kind of step)

    def bench(self, num_prompts: int, workers: int) -> dict:
        # the load generator in this process (`specdp bench serve`'s run_bench): a round starts within a second of
        # the run before it (--interleave), where the CLI's start-up took seconds
        return run_bench(self.url, self.prompts_path, self.a.concurrency, num_prompts, self.a.max_tokens, None, None,
                         workers=workers, loop=self.a.client_event_loop)

    def round(self, workers: int, i: int) -> dict:
        """A measured round: the bench result with the server's steps and busy seconds over it."""
        before = steps_so_far(self.url)
        acct = cpu_account(self.a.rank_cpu, self.rank_pid)
        front_s, clients_s = processes_cpu_s(self.frontend_pids), sum(os.times()[2:4])
        r = self.bench(self.a.requests, workers)
        r["cpu_account"] = account_delta(acct, cpu_account(self.a.rank_cpu, self.rank_pid))
        # the API servers' CPU and the load generator's worker processes' (from their start, imports and all:
        # reaped at the round's end) over the round's seconds
        r["frontend_cpu_share"] = (processes_cpu_s(self.frontend_pids) - front_s) / r["duration_s"]
        r["clients_cpu_share"] = (sum(os.times()[2:4]) - clients_s) / r["duration_s"]
        with open(os.path.join(self.a.work, f"bench_{self.tag}_w{workers}_{i}.json"), "w") as fh:
            json.dump(r, fh)
        after = steps_so_far(self.url)                     # (the last step's count may arrive a step late)
        r.update({key: after[key] - before[key] for key in STEP_COUNTS})
        r.update({key: int(r[key]) for key in ("steps", "planned_ahead", "chunk_steps")})
        r["ms_per_step"] = r["duration_s"] / max(r["steps"], 1) * 1e3
        r["t_end"] = time.time()
        return r

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def served(a, method: str, cachings: list[bool], prompts_path: str, proc: int,
           before_round=None) -> dict[tuple[bool, int], list[dict]]:
    """The measured rounds of each server (method, caching) for each --client-workers count. One server at a time;
    with --interleave all of them at once, their rounds taking turns, and `before_round` (an interleaved offline
    run) called before each round."""
    together = a.interleave
    engines = len(cachings) + (before_round is not None)      # on the GPU at once (--interleave): 0.9 shared evenly,
    servers, results = [], {}                                 # the offline engine (started last) taking the rest
    try:
        for j, caching in enumerate(cachings):
            if not together and servers:
                servers.pop().stop()
            tag = f"{method}_{'on' if caching else 'off'}_p{proc}"
            servers.append(Server(a, method, caching, prompts_path, tag, a.port + j if together else a.port,
                                  round(0.9 * (j + 1) / engines, 3) if together and engines > 1 else None))
            servers[-1].wait_ready()
            if not together:
                for workers in a.client_workers:
                    results[(caching, workers)] = [servers[-1].round(workers, i) for i in range(a.rounds)]
        if together:
            for workers in a.client_workers:
                for i in range(a.rounds):
                    for caching, server in zip(cachings, servers):
                        if before_round is not None:
                            before_round()
                        results.setdefault((caching, workers), []).append(server.round(workers, i))
        return results
    finally:
        for server in servers:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--target")
    ap.add_argument("--methods", default="none,draft_model")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--prefix", type=int, default=0)
    ap.add_argument("--caching", default="on")
    ap.add_argument("--rounds", type=int, default=3, help="measured runs, offline and served; the median is reported")
    ap.add_argument("--processes", type=int, default=1,
                    help="offline processes and servers per method, alternating (offline, served, offline, ...); the "
                    "median is over every process's rounds: on the H200 machines two processes of one side ran up "
                    "to 2x apart on the same machine")
    ap.add_argument("--client-workers", default="1",
                    help="load-generating processes of `bench serve`, a list: each count measured on the same server")
    ap.add_argument("--client-event-loop", default="asyncio", choices=event_loop.KINDS,
                    help="the load generator's event loop (`specdp bench serve --event-loop`)")
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--interleave", action="store_true",
                    help="rounds take turns: an offline run before each served round (one offline process beside the "
                         "server), and with --caching on,off both servers up at once, a round each in turn")
    ap.add_argument("--api-servers", type=int, default=1, help="server.api_server_count: HTTP frontend processes")
    ap.add_argument("--rank-cpu", type=int,
                    help="the served ranks and the offline process on this CPU (taking turns with --interleave), "
                         "everything else on the others: both sides on the same CPU, where on the H200 machines one "
                         "process's speed depended on the CPU it ran on, up to 2x")
    ap.add_argument("--share-core", action="store_true",
                    help="with --rank-cpu: leave the rank CPU's hyperthread siblings to everything else (before "
                         "session 30; by default nothing else runs on the rank's physical core)")
    ap.add_argument("--keep-free", default="",
                    help="with --rank-cpu: CPUs (comma-separated) that nothing else runs on either, e.g. a vCPU that "
                         "shares the rank's physical core where the guest cannot see it (cpu_contention.py --each-cpu)")
    ap.add_argument("--rank-threads", type=int,
                    help="OMP_NUM_THREADS for the server and the offline process: a GPU rank's intra-op threads "
                         "(default: the product's, launch.threads_per_rank)")
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--label", default="")
    ap.add_argument("--work", required=True)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    a.rank_core = [] if a.rank_cpu is None else [a.rank_cpu] if a.share_core else core_of(a.rank_cpu)
    a.rank_core += [int(c) for c in a.keep_free.split(",") if c] if a.rank_cpu is not None else []
    if a.rank_cpu is not None:      # this process and what it starts (the server, its frontend; not its ranks)
        os.sched_setaffinity(0, os.sched_getaffinity(0) - set(a.rank_core))
    a.pair = os.path.abspath(a.pair)
    a.client_workers = [int(w) for w in a.client_workers.split(",")]
    a.target = os.path.abspath(a.target) if a.target else None
    os.makedirs(a.work, exist_ok=True)
    prompts = (prefix_prompts(a.pair, a.prefix, a.requests) if a.prefix else
               cut_prompt_ids(a.pair, 4, a.requests))
    prompts_path = os.path.join(a.work, "prompts.jsonl")
    with open(prompts_path, "w") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p}) + "\n")
    rows = []
    for method in a.methods.split(","):
        cachings = [c == "on" for c in a.caching.split(",")]
        off_rows: list[dict] = []
        rounds: dict[tuple[bool, int], list[dict]] = {}
        interleaved = a.interleave and not (a.no_offline or a.prefix)
        for proc in range(a.processes):
            off_rows += [] if a.no_offline or a.prefix or interleaved else offline(a, method, proc)
            turns = OfflineRounds(a, method) if interleaved else None
            try:
                res = served(a, method, cachings, prompts_path, proc, turns.run_round if turns else None)
            finally:
                if turns:
                    turns.close()
                    off_rows += turns.rows
            for key, rs in res.items():
                rounds.setdefault(key, []).extend(rs)
        # interleaved: each served round over the offline run just before it (in the order they ran)
        pair_ratios = ([r["output_throughput"] / o["tok_s"] for r, o in zip(next(iter(rounds.values())), off_rows)]
                       if interleaved and len(rounds) == 1 else None)
        # interleaved caching on and off: each round's on over the off round beside it (throughput; off's TTFT over on's)
        on_off = {w: [(on["output_throughput"] / off_["output_throughput"], off_["ttft_ms"]["median"] / on["ttft_ms"]["median"])
                      for on, off_ in zip(rounds[(True, w)], rounds[(False, w)])]
                  for w in a.client_workers if a.interleave and (True, w) in rounds and (False, w) in rounds}
        off_rows.sort(key=lambda r: r["tok_s"])
        off_row = off_rows[len(off_rows) // 2] if off_rows else None
        off = off_row["tok_s"] if off_row else None
        for (caching, workers), rs in rounds.items():
            rs.sort(key=lambda r: r["output_throughput"])
            r = rs[len(rs) // 2]
            row = {"label": a.label, "method": method, "caching": caching, "dp": a.dp, "prefix": a.prefix,
                   "api_servers": a.api_servers, "rank_cpu": a.rank_cpu, "rank_core": a.rank_core,
                   "client_workers": workers, "client_event_loop": a.client_event_loop, "processes": a.processes,
                   "rank_threads": a.rank_threads,
                   "served_tok_s": r["output_throughput"], "offline_tok_s": off,
                   "served_rounds_tok_s": [x["output_throughput"] for x in rs],
                   "offline_rounds_tok_s": [x["tok_s"] for x in off_rows],
                   "served_over_offline": r["output_throughput"] / off if off else None,
                   "interleaved": interleaved, "round_pair_ratios": pair_ratios,
                   "pair_ratio_median": statistics.median(pair_ratios) if pair_ratios else None,
                   "on_over_off_pairs": on_off.get(workers) if caching else None,
                   "on_over_off_median": ([statistics.median(x for x, _ in on_off[workers]),
                                           statistics.median(y for _, y in on_off[workers])]
                                          if caching and workers in on_off else None),
                   "ttft_ms": r["ttft_ms"], "itl_ms": r["itl_ms"], "tpot_ms": r["tpot_ms"],
                   "acceptance_rate": r["acceptance_rate"], "completed": r["completed"], "failed": r["failed"],
                   "server_queue_ms": r.get("server_queue_ms"), "server_prefill_ms": r.get("server_prefill_ms"),
                   "server_ttft_ms": r.get("server_ttft_ms"), "output_tokens": r["total_output_tokens"],
                   # tokens a step and a step's time: fewer tokens a step served = emptier batches (the
                   # closed-loop clients' gaps), a longer step = more work in it or host time around it
                   "served_steps": r["steps"], "served_ms_per_step": r["ms_per_step"],
                   "offline_steps": off_row["steps"] if off_row else None,
                   "offline_ms_per_step": off_row["ms_per_step"] if off_row else None,
                   # steps planned ahead (async scheduling) and steps with prompt chunks, each side
                   "served_planned_ahead": r["planned_ahead"], "served_chunk_steps": r["chunk_steps"],
                   # the served ranks' seconds busy (not waiting for requests): a step's time without the waits
                   "served_busy_s": r["busy_s"],
                   # CPUs busy over the round (1.0: one CPU all the time): the API servers, the load generator's
                   # workers (start-up included)
                   "frontend_cpu_share": r.get("frontend_cpu_share"), "clients_cpu_share": r.get("clients_cpu_share"),
                   "served_busy_ms_per_step": r["busy_s"] / a.dp / max(r["steps"], 1) * 1e3,
                   # of it inside the engine's step (the rest: the serving loop's own work), against offline's
                   # ms a step (all of it in the engine's step)
                   "served_engine_ms_per_step": r["step_s"] / a.dp / max(r["steps"], 1) * 1e3,
                   # prompt tokens found in the prefix cache over those looked up, all of this row's rounds (every
                   # rank; with --dp 2 where the frontend's prefix-aware routing sent them)
                   "prefix_hit_rate": (sum(x["prefix_hits"] for x in rs) / sum(x["prefix_queries"] for x in rs)
                                       if sum(x["prefix_queries"] for x in rs) else None),
                   "offline_planned_ahead": off_row.get("planned_ahead") if off_row else None,
                   "offline_chunk_steps": off_row.get("chunk_steps") if off_row else None,
                   # the rank processes' garbage collections a step: milliseconds (each side's median round)
                   "served_gc_ms_per_step": statistics.median(x["gc_pause_s"] / a.dp / max(x["steps"], 1) * 1e3
                                                              for x in rs),
                   "offline_gc_ms_per_step": (statistics.median(x["gc_pause_s"] / max(x["steps"], 1) * 1e3
                                                                for x in off_rows)
                                              if off_rows and all("gc_pause_s" in x for x in off_rows) else None),
                   # --rank-cpu: the rank CPU's time a step by kind, its interrupts and the process's context
                   # switches a step (medians over each side's rounds; cpu_account)
                   "served_cpu_per_step": per_step(rs, "steps"),
                   "offline_cpu_per_step": per_step(off_rows, "steps")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "requests": a.requests,
            "concurrency": a.concurrency, "max_tokens": a.max_tokens}
    with open(a.json, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"{'method':<12}{'caching':>8}{'clients':>8}{'served tok/s':>13}{'offline':>9}{'ratio':>7}{'pairs':>7}{'TTFT p50':>9}{'TTFT p99':>9}"
          f"{'ITL p50':>8}{'ITL p99':>8}{'accept':>8}{'queue':>7}{'prefill':>8}{'srv TTFT':>9}{'steps s/o':>13}{'ms/step s/o':>13}{'busy ms/step':>13}{'in step':>8}")
    for r in rows:
        off = f"{r['offline_tok_s']:.0f}" if r["offline_tok_s"] else "-"
        ratio = f"{r['served_over_offline']:.2f}" if r["served_over_offline"] else "-"
        pairs = f"{r['pair_ratio_median']:.2f}" if r["pair_ratio_median"] else "-"     # --interleave: the median pair
        if r["on_over_off_median"]:        # caching on over off, throughput (and lower TTFT), the median pair
            pairs = f"{r['on_over_off_median'][0]:.2f}"
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        print(f"{r['method']:<12}{'on' if r['caching'] else 'off':>8}{r['client_workers']:>8}{r['served_tok_s']:>13.0f}{off:>9}{ratio:>7}{pairs:>7}"
              f"{r['ttft_ms']['median']:>9.1f}{r['ttft_ms']['p99']:>9.1f}{r['itl_ms']['median']:>8.2f}"
              f"{r['itl_ms']['p99']:>8.2f}{acc:>8}{r['server_queue_ms'] or 0:>7.1f}{r['server_prefill_ms'] or 0:>8.1f}"
              f"{r['server_ttft_ms'] or 0:>9.1f}{r['served_steps']:>7}/{r['offline_steps'] or 0:<5}"
              f"{r['served_ms_per_step']:>7.2f}/{r['offline_ms_per_step'] or 0:<5.2f}{r['served_busy_ms_per_step']:>13.2f}"
              f"{r['served_engine_ms_per_step']:>8.2f}")
    for r in rows:
        if r["prefix_hit_rate"] is not None and r["caching"]:
            print(f"{r['method']:<12} prefix cache hit rate over the rounds: {r['prefix_hit_rate']:.3f} (dp {r['dp']})")
    for r in rows:
        print(f"{r['method']:<12} the rank's garbage collections a step, served / offline: "
              f"{r['served_gc_ms_per_step'] * 1e3:.1f} / "
              + (f"{r['offline_gc_ms_per_step'] * 1e3:.1f} us" if r["offline_gc_ms_per_step"] is not None else "- us"))
    for r in rows:
        if r.get("frontend_cpu_share") is not None:
            print(f"{r['method']:<12} CPUs busy over the median round: API servers {r['frontend_cpu_share']:.2f}, "
                  f"load generator {r['clients_cpu_share']:.2f} ({r['client_workers']} processes, start-up included)")
    for r in rows:          # --rank-cpu: the rank CPU's time a step, served / offline
        sv, of = r["served_cpu_per_step"], r["offline_cpu_per_step"]
        if sv and of:
            print(f"{r['method']:<12} rank CPU a step, served / offline: " + ", ".join(
                f"{k.replace('_ctxt_switches', ' switches')} {sv[k]:.{3 if 'switch' in k or k == 'interrupts' else 1}f}"
                f"/{of[k]:.{3 if 'switch' in k or k == 'interrupts' else 1}f}"
                for k in sv if k in of and (sv[k] or of[k])))


if __name__ == "__main__":
    main()
