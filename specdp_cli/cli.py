"""The `specdp` command line: thin wrappers that parse, call and print.

Exit status everywhere: 0 success, 1 the configuration or the job failed (or the server cannot run),
2 usage errors (found before any work), 130 interrupted, 143 stopped by SIGTERM.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from .config import Config, ConfigError, UsageError, load_config
from .plan import world_size
from .preflight import Report, run_preflight, schema_failure
from .report_view import print_report, report_json

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Data-parallel speculative decoding on Hugging Face models.")
validate_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Check before you launch.")
app.add_typer(validate_app, name="validate")

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)


def _hide_flag_types() -> None:
    """typer prints each option's type in --help, `<bool>` after value-less flags too (--json <bool>), which
    reads as if they took a value: flags show none. Guarded: an older or newer typer without this hook is
    left as it is."""
    try:
        from typer.core import TyperOption
    except ImportError:
        return
    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_specdp", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) and not getattr(self, "count", False) else shown(self, ctx)
    display_type_rich._specdp = True
    TyperOption.display_type_rich = display_type_rich


_hide_flag_types()

SetOpt = typer.Option(None, "--set", metavar="KEY=VALUE",
                      help="Override a config value, e.g. --set speculative.num_speculative_tokens=3 (repeatable).")
DpOpt = typer.Option(None, "--dp", min=1, help="Shortcut for --set parallel.data_parallel_size=N.")
DeviceOpt = typer.Option(None, "--device", help="Shortcut for --set device=cpu|cuda|auto.")


DEVICES = ("cpu", "cuda", "auto")


def overrides(sets: Optional[List[str]], dp: Optional[int] = None, device: Optional[str] = None, **extra) -> list[str]:
    items = list(sets or [])
    if dp is not None:
        items.append(f"parallel.data_parallel_size={dp}")
    if device is not None:
        if device not in DEVICES:
            fail_usage(f"--device must be one of {', '.join(DEVICES)} (got {device!r})")
        items.append(f"device={device}")
    items += [f"{k}={v}" for k, v in extra.items() if v is not None]
    return items


def fail_usage(msg: str) -> None:
    stderr.print("[bold red]usage error:[/] ", end="")
    stderr.print(msg, markup=False, highlight=False)
    raise typer.Exit(2)


def load_or_exit(config_path: Path, items: list[str], as_json: bool = False) -> Config:
    """The configuration, or its errors printed and exit 1 (usage problems exit 2)."""
    try:
        return load_config(config_path, items)
    except UsageError as e:
        if as_json:              # --json promises one object on stdout, also for a file it cannot read
            print(report_json(schema_failure([str(e)], "config")))
            raise typer.Exit(2) from None
        fail_usage(str(e))
    except ConfigError as e:
        report = schema_failure(e.problems)
        if as_json:
            print(report_json(report))
        else:
            stderr.print("[bold red]configuration error[/] in " + str(config_path), highlight=False)
            for p in e.problems:
                stderr.print(f"  - {p}", markup=False, highlight=False)
        raise typer.Exit(1) from None


def preflight_or_exit(cfg: Config, as_json: bool = False, quiet_ok: bool = False) -> Report:
    """Preflight; on errors print them and exit 1."""
    report = run_preflight(cfg)
    if as_json:
        print(report_json(report))
    elif not (quiet_ok and report.ok and not report.warnings):
        print_report(report, stdout if not quiet_ok else stderr)
    if not report.ok:
        if quiet_ok:
            stderr.print("[bold red]refusing to start[/]: fix the errors above (`specdp validate config` shows them).")
        raise typer.Exit(1)
    return report


@contextlib.contextmanager
def stop_signals():
    """SIGTERM raises Terminated in the main thread while a job runs (Python's default would end the
    process at once, silently, leaving part files and ranks behind)."""
    import signal

    from .launch import Terminated

    def on_term(_signum, _frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def early_ranks(cfg: Config, launched: bool):
    """Start this machine's ranks before preflight when the job runs in launched ranks: they spend
    seconds on imports before they need the job (launch.py). Whatever ends the command before the
    job is written — refused checks, bad inputs, Ctrl-C — stops them."""
    if not launched:
        yield None
        return
    from .launch import Ranks

    ranks = Ranks(cfg)
    ranks.start()
    try:
        yield ranks
    except BaseException:
        if not os.path.exists(ranks.run_dir.file("job.json")):
            ranks.abandon()
        raise


@validate_app.command("config")
def validate_config(
    config: Path = typer.Argument(..., help="Config file (.yaml, .yml or .toml)."),
    set_: Optional[List[str]] = SetOpt,
    dp: Optional[int] = DpOpt,
    device: Optional[str] = DeviceOpt,
    as_json: bool = typer.Option(False, "--json", help="Print exactly one JSON object on stdout."),
) -> None:
    """Check a configuration and its model directories without loading weights."""
    preflight_or_exit(load_or_exit(config, overrides(set_, dp, device), as_json), as_json=as_json)


@app.command("generate")
def generate(
    config: Path = typer.Argument(..., help="Config file (.yaml, .yml or .toml)."),
    input: Optional[Path] = typer.Option(None, "--input", "-i", help="Prompts: .jsonl/.json (one JSON object a line) or text (one prompt a line)."),
    output: Path = typer.Option(..., "--output", "-o", help="Results, one JSON line per input, in input order."),
    set_: Optional[List[str]] = SetOpt,
    dp: Optional[int] = DpOpt,
    device: Optional[str] = DeviceOpt,
    summary_json: Optional[Path] = typer.Option(None, "--summary-json", help="Also write the summary as JSON here."),
    retry_errors: bool = typer.Option(False, "--retry-errors", help="On resume, serve again inputs whose earlier result was an error."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start afresh: drop earlier results in --output and its part files."),
) -> None:
    """Run an offline batch job over the data-parallel ranks (resumable: rerun the same command)."""
    import time

    from .launch import process_start_time

    t0 = process_start_time()
    cfg = load_or_exit(config, overrides(set_, dp, device))
    out = output.expanduser().resolve()
    # usage errors before any work: before preflight, before a rank starts
    if cfg.parallel.machine_rank == 0:
        if input is None:
            fail_usage("--input is required (on machine 0)")
        if not input.is_file():
            fail_usage(f"input file not found: {input}" + (" (it is a folder)" if input.is_dir() else ""))
    if out.is_dir():
        fail_usage(f"--output names a folder: {out}; give a file path, e.g. {out / 'out.jsonl'}")
    if not out.parent.is_dir():
        fail_usage(f"the output's folder does not exist: {out.parent}")
    if summary_json is not None:
        sj = summary_json.expanduser().resolve()
        if sj.is_dir() or not sj.parent.is_dir():
            fail_usage(f"--summary-json must be a file in an existing folder (got {summary_json})")
    from .jobs import JobFailed

    try:
        with stop_signals(), early_ranks(cfg, launched=world_size(cfg.parallel) > 1) as ranks:
            from .jobs.run_generate import print_summary, run_generate    # imports torch: after the ranks start

            report = preflight_or_exit(cfg, quiet_ok=True)
            summary = run_generate(cfg, report.plan, str(input) if input else None, str(out), retry_errors, stderr,
                                   ranks, overwrite)
    except JobFailed as e:
        stderr.print("[bold red]job failed[/]: ", end="")
        stderr.print(str(e), markup=False, highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt as e:
        from .launch import Terminated

        term = isinstance(e, Terminated)
        stderr.print(f"{'stopped by SIGTERM' if term else 'interrupted'}; finished results are kept beside {out} "
                     f"— rerun the same command to resume")
        raise typer.Exit(143 if term else 130) from None
    if summary is None:
        stderr.print("done (this machine's ranks finished; machine 0 writes the output and summary)")
        return
    summary["wall_s"] = time.time() - t0
    print_summary(summary, stdout)
    stdout.print(f"output: {out}")
    if summary_json is not None:
        with open(summary_json, "w") as fh:
            json.dump(summary, fh, indent=1)


@app.command("serve")
def serve(
    config: Path = typer.Argument(..., help="Config file (.yaml, .yml or .toml)."),
    host: Optional[str] = typer.Option(None, "--host", help="Shortcut for --set server.host=..."),
    port: Optional[int] = typer.Option(None, "--port", min=0, max=65535, help="Shortcut for --set server.port=..."),
    api_server_count: Optional[int] = typer.Option(None, "--api-server-count", min=1, max=64,
                                                   help="Shortcut for --set server.api_server_count=..."),
    set_: Optional[List[str]] = SetOpt,
    dp: Optional[int] = DpOpt,
    device: Optional[str] = DeviceOpt,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)."""
    items = overrides(set_, dp, device, **{"server.host": host, "server.port": port,
                                           "server.api_server_count": api_server_count})
    cfg = load_or_exit(config, items)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        fail_usage("specdp serve needs fastapi, uvicorn and prometheus_client: pip install -e '.[serve]' in the "
                   "specdp checkout (or pip install fastapi uvicorn prometheus_client)")
    from .server import event_loop
    from .server.run import port_problem, run_server

    if cfg.server.event_loop == "uvloop" and not event_loop.installed():
        fail_usage(event_loop.MISSING)

    if cfg.parallel.machine_rank == 0:            # the server cannot run: say so before any work
        problem = port_problem(cfg.server.host, cfg.server.port)
        if problem:
            stderr.print(f"[bold red]cannot serve[/]: {problem}", highlight=False)
            raise typer.Exit(1)

    with early_ranks(cfg, launched=True) as ranks:
        report = preflight_or_exit(cfg, quiet_ok=True)
        code = run_server(cfg, report.plan, stderr, ranks)
    raise typer.Exit(code)


bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks against a running server.")
app.add_typer(bench_app, name="bench")


@bench_app.command("serve")
def bench_serve(
    base_url: str = typer.Option("http://127.0.0.1:8000", "--base-url", "--url",
                                 help="Base URL of an OpenAI-compatible server."),
    dataset_path: Optional[Path] = typer.Option(None, "--dataset-path", "--input", "-i",
                                                help="Prompts (.jsonl with \"prompt\": a string or token ids; or "
                                                     "text lines); default: a built-in set."),
    num_prompts: int = typer.Option(64, "--num-prompts", "--num-requests", min=1, help="Requests to send in all."),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", "--concurrency", min=1,
                                                  help="Requests in flight at most (default: no limit)."),
    request_rate: float = typer.Option(float("inf"), "--request-rate", min=0.0,
                                       help="Requests per second, Poisson arrivals (default inf: all at once)."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="max_tokens of every request."),
    model: Optional[str] = typer.Option(None, "--model", help="Model name (default: the server's first)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="SPECDP_API_KEY", help="Bearer token."),
    seed: int = typer.Option(0, "--seed", help="Seed of the arrival times."),
    num_workers: int = typer.Option(1, "--num-workers", min=1,
                                    help="Load-generating processes (the streams and the rate split between them): "
                                         "more than one when one process's event loop cannot keep up."),
    loop: str = typer.Option("asyncio", "--event-loop",
                             help="The load generator's event loop: asyncio (as vLLM's), uvloop, or auto (uvloop where "
                                  "installed)."),
    save_result: bool = typer.Option(False, "--save-result", help="Write the results as JSON (see --result-filename)."),
    result_filename: Optional[Path] = typer.Option(None, "--result-filename", "--json",
                                                   help="Where --save-result writes (implies it); default: "
                                                        "specdp-bench-<rate>qps-<concurrency>-<time>.json."),
) -> None:
    """Load-test a server as `vllm bench serve` does (same flag names and metrics: TTFT, TPOT, ITL,
    throughput; plus acceptance from a specdp server's /metrics)."""
    import time

    if request_rate <= 0:
        fail_usage("--request-rate must be > 0 (inf: all at once)")
    if dataset_path is not None and not dataset_path.is_file():
        fail_usage(f"dataset file not found: {dataset_path}")
    from .server import event_loop

    if loop not in event_loop.KINDS:
        fail_usage(f"--event-loop must be {', '.join(event_loop.KINDS[:-1])} or {event_loop.KINDS[-1]}, not {loop!r}")
    if loop == "uvloop" and not event_loop.installed():
        fail_usage("--event-loop uvloop: uvloop is not installed (pip install uvloop, or --event-loop auto)")
    if result_filename is not None:
        save_result = True
        if not result_filename.expanduser().resolve().parent.is_dir():
            fail_usage(f"the folder of --result-filename does not exist: {result_filename.parent}")
    from .bench_serve import BenchError, print_results, run_bench

    try:
        res = run_bench(base_url, str(dataset_path) if dataset_path else None, max_concurrency, num_prompts,
                        max_tokens, model, api_key, request_rate, seed, num_workers, loop)
    except BenchError as e:
        stderr.print("[bold red]bench failed[/]: ", end="")
        stderr.print(str(e), markup=False)
        raise typer.Exit(1) from None
    print_results(res, stdout)
    if save_result:
        path = result_filename or Path(f"specdp-bench-{request_rate}qps-{max_concurrency or 'all'}-"
                                       f"{time.strftime('%Y%m%d-%H%M%S')}.json")
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)
        stdout.print(f"results: {path}")
    if res["completed"] == 0:
        stderr.print("[bold red]bench failed[/]: every request failed (see the errors above)")
        raise typer.Exit(1)


def main() -> None:
    try:
        app(prog_name="specdp")
    except KeyboardInterrupt:
        stderr.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
