"""The `specdp` command as a test runs it, without its start-up: a helper process imports the command and what
it imports (torch, transformers: about 4 of the ~12 CPU-seconds a 2-rank launch costs) once, then forks a copy
of itself for each command; the copy sets the test's environment, working folder and argv, sends its output to
files and runs `specdp_cli.cli.main`, a process of its own (the ranks it starts are fresh ones, as always).

`FORKS.run(args, env, cwd, timeout)` -> (returncode, stdout, stderr); a command still running after `timeout` is
killed and `subprocess.TimeoutExpired` raised, as `subprocess.run` does. `FORKS.start(args, env, cwd)` -> the
running command, used as a `subprocess.Popen` is (a server). `python tests/cli_forks.py SOCKET` is the helper: it
listens on the Unix socket SOCKET and leaves when its stdin closes (the test process is gone).
"""
from __future__ import annotations

import os
import pickle
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

# what a `generate` / `validate config` command imports on its way (the rest it imports itself)
PRELOAD = ("specdp_cli.cli", "specdp_cli.jobs.run_generate", "specdp_cli.launch", "specdp_cli.preflight",
           "transformers", "transformers.tokenization_utils_base", "transformers.tokenization_utils_tokenizers",
           "transformers.models.auto.tokenization_auto", "specdp_cli.server.run", "specdp_cli.server.app")


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

    def start(self, args: list[str], env: dict, cwd: str) -> "Forked":
        """`specdp ARGS` started: a process used as a `subprocess.Popen` is."""
        out_dir = tempfile.mkdtemp(prefix="specdp-cli-out-")
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(self._started())
        out, err = os.path.join(out_dir, "stdout"), os.path.join(out_dir, "stderr")
        _send(sock, {"argv": list(args), "env": env, "cwd": cwd, "stdout": out, "stderr": err})
        return Forked(sock, _recv(sock), out_dir, ["specdp", *args])

    def run(self, args: list[str], env: dict, cwd: str, timeout: float) -> tuple[int, str, str]:
        proc = self.start(args, env, cwd)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        out, err = proc.communicate()
        return proc.returncode, out, err


class Forked:
    """A forked command as a `subprocess.Popen` (text mode, stdout and stderr captured) is used: pid, args,
    returncode, poll, wait, send_signal, kill, communicate, and stderr.read() once it has ended."""

    def __init__(self, sock: socket.socket, pid: int, out_dir: str, args: list[str]):
        self.sock, self.pid, self.args, self._dir = sock, pid, args, out_dir
        self.returncode: int | None = None
        self.stderr = _Stream(os.path.join(out_dir, "stderr"))
        self._output: tuple[str, str] | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select_ready(self.sock, 0):
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select_ready(self.sock, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._ended()
        return self.returncode

    def _ended(self) -> None:
        code = _recv(self.sock)                     # None: killed by a signal before it could say
        self.sock.close()
        self.returncode = -signal.SIGKILL if code is None else code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._output is None:
            files = [os.path.join(self._dir, name) for name in ("stdout", "stderr")]
            self._output = (_read(files[0]), _read(files[1]))
            for f in files:
                if os.path.exists(f):
                    os.unlink(f)
            os.rmdir(self._dir)
        return self._output


class _Stream:
    """A finished command's stderr, read as a pipe's would be."""

    def __init__(self, path: str):
        self.path = path

    def read(self) -> str:
        return _read(self.path)


def select_ready(sock: socket.socket, timeout: float | None) -> bool:
    """Whether the command's end (its status, or the connection closed) arrived within `timeout` seconds."""
    return bool(select.select([sock], [], [], timeout)[0])


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
