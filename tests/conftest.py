import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from helpers import build_tokenizer, make_model_dir  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def temp_dir_inside_pytests(tmp_path_factory):
    """Run directories (kept with their logs when a job fails) and whatever else the commands under
    test put in the temporary directory land in pytest's own temp tree, which pytest prunes: the
    tests leave nothing behind in /tmp."""
    d = tmp_path_factory.mktemp("tmpdir")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(d)
    tempfile.tempdir = None                 # gettempdir() reads TMPDIR again
    yield d
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict:
    """A shared set of tiny model directories: tokenizer, target, drafter (Llama)."""
    root = tmp_path_factory.mktemp("models")
    tok = root / "tokenizer"
    build_tokenizer(tok)
    return {
        "root": root,
        "tokenizer": tok,
        "target": make_model_dir(root / "target", tok, layers=2, seed=1),
        "draft": make_model_dir(root / "draft", tok, layers=1, hidden=32, heads=2, kv_heads=1, seed=2),
    }


@pytest.fixture(scope="session", autouse=True)
def interpreted_kernels_ahead(request, temp_dir_inside_pytests):
    """test_kernels_interpreted's interpreter process (a single CPU-bound thread, about 30 s), started with the session
    at niceness 19 when that test is selected: it runs on the CPU time the modules before it leave idle, and the
    test collects it (at normal priority, with its hard timeout)."""
    if not any(getattr(item, "originalname", None) == "test_kernels_under_the_triton_interpreter"
               for item in request.session.items):
        yield None
        return
    import test_kernels_interpreted as tki

    run = tki.Interpreted(niceness=19)
    tki.AHEAD.append(run)
    yield run
    run.kill()                  # a session that ended before the test (-x, Ctrl-C) leaves nothing running


@pytest.fixture(scope="session", autouse=True)
def ranks_forked():
    """Commands run inside the test process (typer's CliRunner) start their launcher and ranks as forks of
    cli_forks' helper, as the commands it forks do: each skips its seconds of imports. SPECDP_TEST_REAL_RANKS=1 (set
    when the command starts) launches real ones."""
    import specdp_cli.launch as launch
    from cli_forks import FORKS, REAL_RANKS, fork_ranks

    start = launch.Ranks.start

    def start_forked(self):
        fork_ranks(None if os.environ.get(REAL_RANKS) == "1" else FORKS.rank_socket())
        start(self)

    launch.Ranks.start = start_forked
    yield
    launch.Ranks.start = start
    fork_ranks(None)


@pytest.fixture(scope="module")
def launches():
    """This module's `dp_util.Launches`: tests' commands started ahead by the module's fixtures, all ended with it."""
    from dp_util import Launches

    pool = Launches()
    yield pool
    pool.close()


def pytest_addoption(parser):
    parser.addoption("--search-seconds", type=float, default=None,
                     help="seconds of randomized search per DP size in test_search.py (default: the suite's budget)")
    parser.addoption("--search-seed", type=int, default=None, help="seed of test_search.py's randomized search")


def pytest_collection_modifyitems(config, items):
    """test_search's hard limit follows --search-seconds (its budget per DP size, plus start-up and checking)."""
    s = config.getoption("--search-seconds")
    if s is not None:
        for item in items:
            if item.module.__name__ == "test_search":
                item.add_marker(pytest.mark.timeout(s + 300))
