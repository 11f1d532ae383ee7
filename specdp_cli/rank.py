"""What `accelerate launch` runs in each rank: `python -m specdp_cli.rank RUN_DIR`.

Imports what it needs (seconds: torch, transformers), waits for the job the CLI writes into RUN_DIR
(the CLI starts the ranks before its own checks, so both happen at once), joins the process group,
builds the engine and runs the job (generate or serve). However it ends, it leaves an exit record
for the CLI to explain.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import traceback


def _silence_libraries() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


def wait_for_job(run_dir: str, status) -> dict:
    """The job, once the CLI has written it. The CLI stops the ranks if its checks fail; should the
    CLI itself be gone, or its run directory, the rank leaves."""
    import time

    from .runtime.dist import alive

    path = os.path.join(run_dir, "job.json")
    parent = int(os.environ.get("SPECDP_PARENT_PID", "0"))
    status.set(0, "waiting for the job")
    pause = 0.002
    while not os.path.exists(path):
        if (parent and not alive(parent)) or not os.path.isdir(run_dir):
            raise RuntimeError("the specdp command that started this rank is gone or gave up the job")
        time.sleep(pause)                 # a file in a local directory: polling is the simple, portable wait
        pause = min(pause * 2, 0.05)
    with open(path) as fh:
        return json.load(fh)


def main(argv: list[str] | None = None) -> None:
    import time

    from .launch import launch_phases, process_start_time

    argv = sys.argv[1:] if argv is None else argv
    run_dir = argv[0]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    from .runtime.status import StatusBoard

    status = StatusBoard(run_dir, rank)

    def on_signal(signum, _frame):
        status.exit("terminated", f"stopped by signal {signum}", 128 + signum)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        _silence_libraries()
        from .config import Config
        from .plan import Plan
        from .runtime.build import build_engine, rank_device
        from .runtime.dist import DPGroup
        from .runtime.faults import Faults

        # the tokenizers' backend, imported while waiting for the job (not AutoTokenizer / AutoConfig: under
        # transformers 5.17 those import its generation stack, ~3 s; modeldir and runtime/models/config.py avoid them)
        import transformers.tokenization_utils_tokenizers  # noqa: F401

        imported_at = time.time()
        job = wait_for_job(run_dir, status)
        job_at = time.time()
        cfg = Config.model_validate(job["config"])
        plan = Plan(**job["plan"])
        device = rank_device(plan, local_rank, int(job["threads"]))
        status.set(0, "joining the process group")
        tp = cfg.parallel.tensor_parallel_size
        if world == 1:
            dp = DPGroup.solo(status)
        else:
            dp = DPGroup.from_env(plan.backend, plan.lockstep, cfg.parallel.collective_timeout_s,
                                  cfg.parallel.check_collectives, device, status, tp_size=tp,
                                  expert_parallel=plan.expert_parallel)
        dp.start_watchdog(job.get("parent_pid"))
        launch = launch_phases(job["started_at"], job["ranks_started_at"], process_start_time(), imported_at,
                               job_at, time.time())
        status.set(0, "loading models")

        def fault_exit(exit_code: int, message: str) -> None:
            status.exit("fault", message, exit_code)
            os._exit(exit_code)

        engine = build_engine(cfg, plan, dp, device, Faults.from_env(dp.world, tp), on_fault_exit=fault_exit,
                              started_at=job["started_at"], launch=launch)
        print(engine.ready_line, file=sys.stderr, flush=True)
        ready = os.path.join(run_dir, f"rank{rank}.ready")        # for the command's own output (ranks.ready_lines)
        with open(ready + ".tmp", "w") as fh:
            fh.write(engine.ready_line)
        os.replace(ready + ".tmp", ready)
        if not dp.leader:
            engine.follow()            # a TP follower: its leader's device work, step by step, until it says stop
        elif job["mode"] == "generate":
            from .jobs.generate import run_rank

            requests = None
            if rank == 0:
                with open(os.path.join(run_dir, "payload.pkl"), "rb") as fh:
                    requests = pickle.load(fh)
            summary = run_rank(engine, dp, job["output"], job["retry_errors"], requests, local_rank == 0,
                               pool_path=os.path.join(run_dir, "work_pool.claims") if dp.world > 1 else None)
            if summary is not None:
                with open(os.path.join(run_dir, "summary.json"), "w") as fh:
                    json.dump(summary, fh)
        elif job["mode"] == "serve":
            from .server.rank import serve_rank

            serve_rank(engine, dp, job)
        else:
            raise ValueError(f"unknown mode {job['mode']!r}")
        status.exit("ok", "", 0)
        dp.close(ok=True)
    except Exception as e:  # noqa: BLE001 - every failure becomes an exit record for the CLI
        kind = getattr(e, "kind", "error")
        msg = str(e) if kind != "error" else f"{type(e).__name__}: {e}"
        status.exit(kind, msg[:2000], 1)
        if kind == "error":
            traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
