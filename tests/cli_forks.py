"""The `specdp` command as a test runs it, without its start-up: a helper process imports the command and what
it imports (torch, transformers: about 4 of the ~12 CPU-seconds a 2-rank launch costs) once, then forks a copy
of itself for each command; the copy sets the test's environment, working folder and argv, sends its output to
files and runs `specdp_cli.cli.main`, a process of its own (the ranks it starts are fresh ones, as always).

`run(args, env, cwd, timeout)` -> (returncode, stdout, stderr); a command still running after `timeout` is
killed and `subprocess.TimeoutExpired` raised, as `subprocess.run` does. `python tests/cli_forks.py SOCKET` is
the helper: it listens on the Unix socket SOCKET and leaves when its stdin closes (the test process is gone).
"""
from __future__ import annotations

import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

# what a `generate` / `validate config` command imports on its way (the rest it imports itself)
PRELOAD = ("specdp_cli.cli", "specdp_cli.jobs.run_generate", "specdp_cli.launch", "specdp_cli.preflight",
           "transformers", "transformers.tokenization_utils_base", "transformers.tokenization_utils_tokenizers",
           "transformers.models.auto.tokenization_auto")


def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket):
    head = _exactly(sock, 4)
    return None if head is None else pickle.loads(_exactly(sock, struct.unpack("!I", head)[0]))


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


class Forks:
    """The helper process, started on first use; `run` is safe from several threads at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._path: str | None = None

    def _started(self) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._path = os.path.join(tempfile.mkdtemp(prefix="specdp-cli-forks-"), "sock")
                self._proc = subprocess.Popen([sys.executable, __file__, self._path], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
                assert self._proc.stdout.readline() == b"ready\n", "the command's fork helper did not start"
            return self._path

    def run(self, args: list[str], env: dict, cwd: str, timeout: float) -> tuple[int, str, str]:
        path = self._started()
        out_dir = tempfile.mkdtemp(prefix="specdp-cli-out-")
        out, err = os.path.join(out_dir, "stdout"), os.path.join(out_dir, "stderr")
        deadline = time.monotonic() + timeout
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(path)
            _send(sock, {"argv": list(args), "env": env, "cwd": cwd, "stdout": out, "stderr": err})
            pid = _recv(sock)
            sock.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                code = _recv(sock)
            except socket.timeout:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(["specdp", *args], timeout, _read(out), _read(err)) from None
        stdout, stderr = _read(out), _read(err)
        for f in (out, err):
            os.unlink(f)
        os.rmdir(out_dir)
        if code is None:                                       # killed by a signal before it could say
            code = -signal.SIGKILL
        return code, stdout, stderr


FORKS = Forks()


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


# -- the helper ------------------------------------------------------------------------------------------------

def _serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)           # the forks are reaped by the system
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(16)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sys.stdin:                    # the test process closed our stdin: it is gone
                if not sys.stdin.buffer.read1(1):
                    return
                continue
            conn, _ = listener.accept()
            if os.fork() == 0:
                sel.close()
                listener.close()
                _command(conn)                              # never returns
            conn.close()


def _command(conn: socket.socket) -> None:
    """In a fork: run the command of the request on `conn`, then leave with its exit status."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        req = _recv(conn)
        os.environ.clear()
        os.environ.update(req["env"])
        tempfile.tempdir = None                             # TMPDIR is read again
        os.chdir(req["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            f = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        _send(conn, os.getpid())
        sys.argv = ["specdp", *req["argv"]]
        from specdp_cli.cli import main

        try:
            main()
            code = 0
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the command's stderr, as an uncaught error would be
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            _send(conn, code)
        finally:
            os._exit(code)


if __name__ == "__main__":
    sys.path[0] = os.getcwd()                      # as `python -m specdp_cli` run here has it (not tests/)
    _serve(sys.argv[1])
