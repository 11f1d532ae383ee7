"""What a newcomer found, replayed (issue 31): the distribution's name, --help, `validate config --json` on a
missing file, `bench serve` when every request fails, the progress rate on resume, the quick start's files,
docs that point outside the repository, imports the package does not declare. (The run directory after SIGTERM,
the ready lines and the progress bar off a terminal: test_generate's SIGTERM test and test_moe's server test; what
a changed configuration names: test_generate's resume test.)"""
import ast
import fnmatch
import http.server
import json
import sys
import threading
from importlib import metadata
from pathlib import Path

from typer.testing import CliRunner

from specdp_cli.cli import app
from helpers import ModelListing

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_the_distribution_is_specdp_and_the_serve_hint_installs_it(monkeypatch, tmp_path):
    assert metadata.distribution("specdp").metadata["Name"] == "specdp"
    monkeypatch.setitem(sys.modules, "fastapi", None)           # as without the serve extra
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {ROOT / 'demo' / 'pair' / 'target'}\n")
    res = runner.invoke(app, ["serve", str(cfg)])
    assert res.exit_code == 2 and "pip install -e '.[serve]'" in res.output, res.output
    assert 'pip install -e ".[serve]"' in (ROOT / "README.md").read_text()


def test_help_shows_no_type_after_value_less_flags():
    for cmd in (["generate", "--help"], ["validate", "config", "--help"], ["bench", "serve", "--help"]):
        res = runner.invoke(app, cmd, terminal_width=200)
        assert res.exit_code == 0 and "--help" in res.output
        assert "<bool>" not in res.output, res.output
    assert "<path>" in runner.invoke(app, ["generate", "--help"], terminal_width=200).output   # valued options keep theirs


def test_validate_json_answers_a_missing_file_with_json(tmp_path):
    res = runner.invoke(app, ["validate", "config", str(tmp_path / "nope.yaml"), "--json"])
    assert res.exit_code == 2
    out = json.loads(res.stdout)
    assert out["ok"] is False and "config file not found" in out["errors"][0] and str(tmp_path / "nope.yaml") in \
        out["errors"][0]


class _FailingServer(ModelListing):
    """Lists a model; answers every completion with a 500."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"error": {"message": "boom"}}'
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_bench_serve_fails_when_every_request_fails():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FailingServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        res = runner.invoke(app, ["bench", "serve", "--base-url", f"http://127.0.0.1:{srv.server_address[1]}",
                                  "--num-prompts", "3", "--max-tokens", "4"])
    finally:
        srv.shutdown()
    assert res.exit_code == 1 and "every request failed" in res.output, res.output


def test_progress_rate_counts_only_this_runs_results(tmp_path):
    """On resume the part files already hold earlier results: they count as done, not as this run's tokens."""
    from specdp_cli.jobs.inputs import id_key
    from specdp_cli.jobs.run_generate import PartFollower

    out = tmp_path / "o.jsonl"
    part = tmp_path / "o.jsonl.rank0.part"
    part.write_text("".join(json.dumps({"id": i, "completion_tokens": 100}) + "\n" for i in range(3)))
    follower = PartFollower(str(out), {id_key(i) for i in range(3)})
    assert follower.poll() == 3 and follower.tokens == 0
    with open(part, "a") as fh:
        fh.write(json.dumps({"id": 3, "completion_tokens": 7}) + "\n")
    assert follower.poll() == 4 and follower.tokens == 7


def test_the_quick_start_leaves_git_status_clean():
    """Every file the README's quick start writes (the output and its job file) is ignored by .gitignore."""
    patterns = [p.strip() for p in (ROOT / ".gitignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    quick = next(line for line in (ROOT / "README.md").read_text().splitlines() if "specdp generate configs/demo.yaml" in line)
    output = quick.split("--output", 1)[1].split()[0]
    for written in (output, output + ".job.json"):
        assert any(fnmatch.fnmatch(written, p.lstrip("/")) for p in patterns), written


def test_docs_point_only_inside_the_repository():
    """A user has the repository alone: the docs name no path that leaves it and no document it lacks."""
    import re

    for doc in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        assert not re.search(r"\.\./\w", text), f"{doc.name} points above the repository"
        for name in re.findall(r"[\w./-]+\.md\b", text):
            assert (ROOT / name).is_file(), f"{doc.name} names {name}, which the repository does not have"


# import name -> the distribution that provides it (the package's dependencies and extras)
PROVIDED_BY = {"torch": "torch", "transformers": "transformers", "accelerate": "accelerate", "typer": "typer",
               "pydantic": "pydantic", "yaml": "PyYAML", "rich": "rich", "numpy": "numpy", "safetensors": "safetensors",
               "tomli": "tomli", "fastapi": "fastapi", "uvicorn": "uvicorn", "matplotlib": "matplotlib",
               "prometheus_client": "prometheus_client", "llguidance": "llguidance", "uvloop": "uvloop",
               "triton": "torch",        # Triton ships inside PyTorch's CUDA wheels (imported on CUDA only)
               "tokenizers": "transformers"}     # transformers' own dependency (a benchmark trains a tokenizer)


def test_every_import_is_declared():
    import re

    toml = (ROOT / "pyproject.toml").read_text()
    declared = {m.lower() for m in re.findall(r'"([A-Za-z0-9_.-]+)\s*[<>=;]', toml)}
    std = set(sys.stdlib_module_names)
    local = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} | {"specdp_cli"}
    for path in [*sorted((ROOT / "specdp_cli").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top in std or top in local:
                    continue
                assert top in PROVIDED_BY, f"{path.relative_to(ROOT)} imports {top}, which no dependency provides"
                assert PROVIDED_BY[top].lower() in declared, f"{path.relative_to(ROOT)}: {PROVIDED_BY[top]} undeclared"
