"""Starting the ranks of this machine with `accelerate launch`, watching them, and turning a
failure into a sentence that names the rank and the phase.

The CLI process is the parent. It starts accelerate (which starts one process per rank) as soon as
the configuration has loaded, before its own checks: a rank spends seconds importing torch and
transformers before it needs its job, and the launcher as many, so that overlaps the checks and
the reading of the inputs. The ranks then wait for the job the CLI writes into the run directory
(or are stopped, when the checks refuse the configuration). The CLI follows the ranks' status
files, and on Ctrl-C / SIGTERM stops them all. accelerate exits 1 whatever went wrong in a rank,
so each rank leaves its own exit record (runtime/status.py) and this module reads those to explain
what happened.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import yaml

from .config import Config
from .plan import Plan, processes_per_machine, world_size
from .runtime.status import read_states

GRACE_S = 10.0


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C (stop, keep what is finished, say how to resume) but exit 143."""


LAUNCH_PHASES = ("cli_s", "spawn_s", "imports_s", "job_wait_s", "join_s")


# more than this between a process's start and its import of specdp: the process was started by another
# program that later exec'ed specdp (the last command of `bash -c '...; specdp ...'`)
EXEC_SLACK_S = 30.0


def process_start_time() -> float:
    """Wall-clock time this process started (Linux: from /proc; elsewhere: when it imported specdp), so a
    command's figures include its own interpreter and import time. /proc gives the time of the fork: when
    that is long before specdp was imported, a shell exec'ed specdp after other work, and the import
    time is the start."""
    from . import IMPORTED_AT

    started = _forked_at()
    return started if started is not None and IMPORTED_AT - started < EXEC_SLACK_S else IMPORTED_AT


def _forked_at() -> float | None:
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class RunDir:
    """The files shared by the parent and the ranks of this machine."""

    def __init__(self, path: str | None = None):
        self.path = path or tempfile.mkdtemp(prefix="specdp-run-")

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def write_job(self, cfg: Config, plan: Plan, mode: str, ranks_started_at: float, **extra) -> None:
        """The job the ranks wait for; written whole (a rename), after any payload."""
        job = {"config": cfg.model_dump(), "plan": asdict(plan), "mode": mode,
               "threads": threads_per_rank(plan.device, plan.ranks_per_machine * plan.tensor_parallel_size),
               "parent_pid": os.getpid(),
               "started_at": process_start_time(), "ranks_started_at": ranks_started_at, **extra}
        with open(self.file("job.json.tmp"), "w") as fh:
            json.dump(job, fh)
        os.replace(self.file("job.json.tmp"), self.file("job.json"))

    def write_payload(self, obj) -> None:
        with open(self.file("payload.pkl"), "wb") as fh:
            pickle.dump(obj, fh)

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def launch_phases(started_at: float, ranks_started_at: float, rank_started_at: float, imported_at: float,
                  job_at: float, joined_at: float) -> dict[str, float]:
    """Where the time before a rank's engine went, as consecutive spans that add up to `launch_s`:
    the CLI until it started the ranks, the launcher until the rank's process started, the rank's
    imports, waiting for the job (the CLI's checks and input reading, when they take longer than the
    imports), joining the process group."""
    marks = [started_at, ranks_started_at, max(ranks_started_at, rank_started_at), imported_at, job_at, joined_at]
    return {name: max(0.0, b - a) for name, a, b in zip(LAUNCH_PHASES, marks, marks[1:])}


def process_state(pid: int) -> str | None:
    """A live process's state letter from /proc (R, S, D, T stopped, Z zombie…); None when it is gone
    or the system has no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def threads_per_rank(device: str, per_machine: int) -> int:
    """A rank's intra-op threads (torch.set_num_threads). A GPU rank's host work is one Python thread; more
    intra-op threads can only contend with it (on one H200 the offline engine ran as fast with 1 as with 4, or up
    to 8 % faster: docs/benchmarks.md, session 31). So GPU ranks take 1, as vLLM's workers do, unless the user set
    OMP_NUM_THREADS."""
    if device == "cuda":
        return user_threads() or 1
    return max(1, (os.cpu_count() or 1) // per_machine)


def user_threads() -> int | None:
    """OMP_NUM_THREADS as this process's environment has it (a positive integer), else None."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return n if n > 0 else None


# what each rank runs after the interpreter, before RUN_DIR: `python -m specdp_cli.rank RUN_DIR` (accelerate takes
# the same "-m MODULE"), and what starts the ranks of several: `python -m accelerate.commands.launch OPTIONS`. The
# test suite (tests/cli_forks.py) puts stand-ins there: each has a helper that imported torch once fork the real
# process, saving it the seconds of imports.
RANK_PROGRAM = ("-m", "specdp_cli.rank")
LAUNCHER = ("-m", "accelerate.commands.launch")


def accelerate_command(cfg: Config, run_dir: RunDir, port: int, threads: int) -> list[str]:
    par = cfg.parallel
    world = world_size(par)               # processes: dp x tp
    # every option is given, in a config file of our own too, so a default accelerate config in
    # the user's home cannot change how ranks start
    acc = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "mixed_precision": "no",
           "num_machines": par.num_machines, "num_processes": world, "machine_rank": par.machine_rank,
           "main_process_ip": par.main_process_ip, "main_process_port": port, "rdzv_backend": "static",
           "same_network": True, "use_cpu": False, "gpu_ids": "all", "dynamo_config": {}, "debug": False}
    cfg_file = run_dir.file("accelerate.yaml")
    with open(cfg_file, "w") as fh:
        yaml.safe_dump(acc, fh)
    return [sys.executable, *LAUNCHER, "--config_file", cfg_file,
            "--multi_gpu", "--num_processes", str(world), "--num_machines", str(par.num_machines),
            "--machine_rank", str(par.machine_rank), "--main_process_ip", par.main_process_ip,
            "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
            "--rdzv_backend", "static", "--same_network", "--monitor_interval", "0.1",
            "--num_cpu_threads_per_process", str(threads),
            *RANK_PROGRAM, run_dir.path]


def rank_env(cfg: Config) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
                "TOKENIZERS_PARALLELISM": "false", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                "SPECDP_PARENT_PID": str(os.getpid())})      # a rank waiting for its job leaves if we are gone
    ip = cfg.parallel.main_process_ip
    if ip.startswith("127.") or ip == "localhost":            # only gloo reads it
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


class Ranks:
    """The ranks of this machine, started through accelerate, watched by the parent."""

    def __init__(self, cfg: Config, run_dir: RunDir | None = None):
        self.cfg = cfg
        self.run_dir = run_dir or RunDir()
        par = cfg.parallel
        n = processes_per_machine(cfg.parallel)
        first = par.machine_rank * n
        self.local_ranks = range(first, first + n)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.run_dir.file("ranks.log")
        self.started_at: float | None = None
        self.port = par.main_process_port or 0
        self.interrupted: int | None = None
        self.states_when_ended: dict[int, str | None] = {}   # process states of silent ranks before we ended them
        self._ready_seen: set[int] = set()

    def start(self) -> None:
        """Start the ranks; they import, then wait for `run_dir/job.json` (see `write_job`). Before
        preflight has run, the device is not known yet: OpenMP threads are set for CPU ranks here and
        each rank applies the job's thread count once it has it."""
        env = rank_env(self.cfg)
        threads = threads_per_rank(self.cfg.device if self.cfg.device != "auto" else "cpu", len(self.local_ranks))
        if world_size(self.cfg.parallel) == 1:
            # one rank needs no launcher (accelerate's --multi_gpu refuses a single process)
            cmd = [sys.executable, *RANK_PROGRAM, self.run_dir.path]
            env.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": str(threads)})
        else:
            cmd = accelerate_command(self.cfg, self.run_dir, self.port, threads)
        self.started_at = time.time()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def ready_lines(self) -> list[str]:
        """The start-up lines ("rank 1 ready in 4.2 s: …") of ranks that became ready since the last call: each
        rank writes its own to rank{r}.ready (its stderr goes to the log file)."""
        out = []
        for r in self.local_ranks:
            if r in self._ready_seen:
                continue
            try:
                with open(self.run_dir.file(f"rank{r}.ready")) as fh:
                    text = fh.read().strip()
            except OSError:
                continue
            self._ready_seen.add(r)
            out.append(text)
        return out

    def states(self):
        return read_states(self.run_dir.path, self.local_ranks)

    def any_failed(self) -> bool:
        return any(s.exit and s.exit.get("kind") != "ok" for s in self.states())

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop accelerate and every rank (ranks run in sessions of their own, so by pid too)."""
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        for s in self.states():
            if s.pid and (s.exit is None):
                try:
                    os.kill(s.pid, sig)
                except ProcessLookupError:
                    pass

    def wait(self, on_tick=None, tick_s: float = 0.1) -> int:
        """Wait for the launcher; returns its status. Ctrl-C / SIGTERM stop everything.
        Once one rank has failed, the rest get `collective_timeout_s` + 20 s to end by themselves."""
        def handler(signum, _frame):
            self.interrupted = signum

        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        failed_at = None
        try:
            while True:
                rc = self.poll()
                if on_tick:
                    on_tick()
                if rc is not None:
                    return rc
                if self.interrupted is not None:
                    self._terminate()
                    return 130 if self.interrupted == signal.SIGINT else 143
                if failed_at is None and self.any_failed():
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > self.cfg.parallel.collective_timeout_s + 20:
                    self._terminate()
                    return 1
                time.sleep(tick_s)
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def abandon(self) -> None:
        """The job will not come (the checks refused it, the inputs are unusable, Ctrl-C): kill the
        ranks — they hold nothing yet but imports — and remove the run directory. A rank too young
        to have said its pid finds this process gone and leaves by itself."""
        if self.proc is not None:
            self.stop(signal.SIGKILL)
            try:
                self.proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        self.run_dir.cleanup()

    def _terminate(self) -> None:
        self.states_when_ended = {s.rank: process_state(s.pid) for s in self.states() if s.exit is None and s.pid}
        self.stop(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        self.stop(signal.SIGKILL)
        if self.proc:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def who(self, proc: int) -> str:
        """A process as messages name it: its rank, or under tensor parallelism its DP and TP rank."""
        tp = max(1, self.cfg.parallel.tensor_parallel_size)
        return f"rank {proc}" if tp == 1 else f"process {proc} (DP rank {proc // tp}, TP rank {proc % tp})"

    def failure_message(self) -> str:
        states = self.states()
        recs = {s.rank: s.exit for s in states if s.exit}
        for rec in recs.values():
            if rec.get("kind") == "out-of-step":
                return rec["message"]
        stalled = [rec["message"] for rec in recs.values() if rec.get("kind") == "no-progress"]
        if stalled:                     # the other ranks stopped with it ("peer-stalled")
            return "\n".join(stalled)
        lines = []
        for s in states:
            rec = s.exit
            if rec is None:
                state = self.states_when_ended.get(s.rank) if s.rank in self.states_when_ended else (
                    process_state(s.pid) if s.pid is not None else None)
                if s.pid is None:
                    lines.append(f"{self.who(s.rank)} did not start (see the log below)")
                elif state in ("T", "t"):
                    lines.append(f"{self.who(s.rank)} is unresponsive at {s.where}: its process {s.pid} is stopped "
                                 f"(SIGSTOP, a debugger?) and was ended")
                elif state is not None and state not in ("Z", "X"):
                    lines.append(f"{self.who(s.rank)} is unresponsive at {s.where}: its process {s.pid} is alive but "
                                 f"stopped answering, and was ended")
                else:
                    lines.append(f"{self.who(s.rank)} died during {s.where} without an exit record "
                                 f"(killed by a signal, e.g. out of memory?)")
            elif rec["kind"] == "fault":
                lines.append(f"{self.who(s.rank)} exited with status {rec['code']} during {s.where} ({rec['message']})")
            elif rec["kind"] in ("error", "graph-capture"):
                lines.append(f"{self.who(s.rank)} failed during {s.where}: {rec['message']}")
        # where the ranks ended by the launcher were: the culprits' partners, or those a rank that lost its peers
        # waited for ("no step sync from rank 0": rank 0 was still in a forward's collective)
        told = bool(lines) or any(rec.get("kind") == "peer-lost" for rec in recs.values())
        for s in states:
            rec = s.exit
            if rec and rec["kind"] == "peer-lost":
                lines.append(f"{self.who(s.rank)} stopped: {rec['message']}")
            elif rec and rec["kind"] == "terminated" and told:
                lines.append(f"{self.who(s.rank)} was stopped at {s.where}")
        if not lines:
            lines.append("the launcher failed before the ranks reported anything")
        return "\n".join(lines)

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return ""
