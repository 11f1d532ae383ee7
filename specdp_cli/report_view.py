"""How a preflight report is shown: a rich table for people, one JSON object for programs."""
from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from .preflight import Report

STYLE = {"ok": "green", "warn": "yellow", "error": "bold red"}


def print_report(report: Report, console: Console, title: str = "specdp preflight") -> None:
    table = Table(title=title, show_lines=True, expand=False)
    table.add_column("check", style="bold")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    for c in report.checks:
        table.add_row(c.name, f"[{STYLE[c.status]}]{c.status}[/]", c.detail)
    console.print(table)
    p = report.plan
    if report.ok:
        window = f"[{p.no_draft_window[0]}, {p.no_draft_window[1]}]" if p.no_draft_window else "none"
        layout = ""
        if p.tensor_parallel_size > 1:
            w = (p.memory or {}).get("weight_bytes")
            layout = (f"layout {p.data_parallel_size} x {p.tensor_parallel_size} (dp x tp)"
                      + (f", weights {w / 2**20:.1f} MiB per GPU" if w is not None else "")
                      + {0: "", 1: ", drafter replicated"}.get(p.draft_tensor_parallel_size, ", drafter split") + "; ")
        console.print(f"[green]OK[/]: {layout}policy {p.policy}, dp_sync {p.dp_sync}, drafter limit D = "
                      f"{p.drafter_max_model_len}, no-draft window {window}"
                      + (f" ({len(report.warnings)} warning(s))" if report.warnings else ""))
    else:
        console.print(f"[bold red]{len(report.errors)} error(s)[/]:")
        for e in report.errors:
            console.print(f"  - {e}", markup=False)


def report_json(report: Report) -> str:
    return json.dumps(report.to_json())
