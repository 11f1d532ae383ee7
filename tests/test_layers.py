"""The code's layers, read from its imports: what runs inside a rank (`specdp_cli/runtime/`) imports nothing above
it — not the jobs, the server, the CLI, the launcher or preflight — and the offline job and the server do not
import each other. Data flows config -> plan -> launch -> rank engine -> results."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specdp_cli"


def imported_packages(path: Path) -> set[str]:
    """The specdp_cli modules a file imports (absolute names), at any depth of the file."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("specdp_cli"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ((node.module,) if node.module else ()))
            else:
                name = node.module or ""
            if name.startswith("specdp_cli"):
                out.add(name)
                out.update(f"{name}.{a.name}" for a in node.names)
    return out


def files_under(sub: str) -> list[Path]:
    return sorted((PACKAGE / sub).rglob("*.py"))


def test_the_runtime_imports_nothing_above_it():
    above = ("jobs", "server", "cli", "launch", "preflight", "rank")
    for f in files_under("runtime"):
        bad = {m for m in imported_packages(f) if m.split(".")[1:2] and m.split(".")[1] in above}
        assert not bad, f"{f.relative_to(PACKAGE.parent)} imports {sorted(bad)}"


def test_jobs_and_server_do_not_import_each_other():
    for sub, other in (("jobs", "server"), ("server", "jobs")):
        for f in files_under(sub):
            bad = {m for m in imported_packages(f) if m.startswith(f"specdp_cli.{other}")}
            assert not bad, f"{f.relative_to(PACKAGE.parent)} imports {sorted(bad)}"


def test_the_reader_sees_relative_imports():
    """The check above would pass vacuously if relative imports were not resolved: the engine's must show."""
    found = imported_packages(PACKAGE / "runtime" / "engine.py")
    assert "specdp_cli.runtime.scheduler" in found and "specdp_cli.plan" in found
