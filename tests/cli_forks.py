"""The `specdp` command as a test runs it, without its start-up: a helper process imports the command and what
it imports (torch, transformers: about 4 of the ~12 CPU-seconds a 2-rank launch costs) once, then forks a copy
of itself for each command; the copy sets the test's environment, working folder and argv, sends its output to
files and runs `specdp_cli.cli.main`, a process of its own (the ranks it starts are fresh ones, as always).

The ranks such a command starts, and accelerate's launcher that starts them, are forked from the helper too (nearly
all of a launch's CPU time was their imports: about 5 CPU-seconds a rank and 2.5 the launcher, against 0.1 left
after the fork). The command starts `python tests/cli_forks.py --launcher OPTIONS` in the launcher's place
(launch.LAUNCHER, set in the command's fork), and the launcher (or the command, for one rank) `python
tests/cli_forks.py --rank RUN_DIR` in a rank's (launch.RANK_PROGRAM): a stand-in of a few milliseconds that hands
the helper its environment, working folder and standard streams. The helper forks a keeper, the keeper forks the
rank (`specdp_cli.rank.main`) or the launcher (`accelerate.commands.launch` as __main__), in a session of its own as
a launched one is, and reports its exit status; the stand-in passes on the signals it gets and leaves as the fork
did, so the launcher and the command see what processes of their own would have done. A stand-in that dies takes its
fork with it. The fork is not the stand-in's child: a test that finds ranks among a command's processes, or stops
them by signal, asks for real ones (SPECDP_TEST_REAL_RANKS=1 in the command's environment).

`FORKS.run(args, env, cwd, timeout)` -> (returncode, stdout, stderr); a command still running after `timeout` is
killed and `subprocess.TimeoutExpired` raised, as `subprocess.run` does. `FORKS.start(args, env, cwd)` -> the
running command, used as a `subprocess.Popen` is (a server). `python tests/cli_forks.py SOCKET` is the helper: it
listens on the Unix socket SOCKET (commands) and SOCKET.rank (ranks, launchers) and leaves when its stdin closes
(the test process is gone).
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

# what a `generate` / `validate config` command imports on its way (the rest it imports itself), and with it nearly
# all a rank imports (torch, torch.distributed, the tokenizers' backend). Nothing whose import reads the environment
# a test may set (Triton's kernels read TRITON_INTERPRET): a rank imports those after the fork, in its own environment.
PRELOAD = ("specdp_cli.cli", "specdp_cli.jobs.run_generate", "specdp_cli.launch", "specdp_cli.preflight",
           "transformers", "transformers.tokenization_utils_base", "transformers.tokenization_utils_tokenizers",
           "transformers.models.auto.tokenization_auto", "specdp_cli.server.run", "specdp_cli.server.app",
           "torch.distributed", "accelerate.commands.launch")
REAL_RANKS = "SPECDP_TEST_REAL_RANKS"          # in a command's environment: its ranks start as launched ones do
RANK_SOCKET = "SPECDP_TEST_RANK_FORKS"         # in a command's environment: where its stand-ins connect


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

    def rank_socket(self) -> str:
        """Where the ranks' stand-ins connect (the helper started if it was not)."""
        return _rank_socket(self._started())

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


_LAUNCHED: tuple | None = None           # launch.RANK_PROGRAM and launch.LAUNCHER as the package has them


def fork_ranks(rank_socket: str | None) -> None:
    """The commands this process runs from now on start their ranks as forks of the helper listening on
    `rank_socket` (its stand-in where each rank would be), or with None as `specdp` itself does."""
    global _LAUNCHED
    import specdp_cli.launch as launch

    if _LAUNCHED is None:
        _LAUNCHED = (launch.RANK_PROGRAM, launch.LAUNCHER)
    if rank_socket is None:
        launch.RANK_PROGRAM, launch.LAUNCHER = _LAUNCHED
        os.environ.pop(RANK_SOCKET, None)
    else:
        launch.RANK_PROGRAM = (os.path.abspath(__file__), "--rank")
        launch.LAUNCHER = (os.path.abspath(__file__), "--launcher")
        os.environ[RANK_SOCKET] = rank_socket


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
    listeners = {}
    for kind, where in (("command", path), ("rank", _rank_socket(path))):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(where)
        listener.listen(16)
        listeners[kind] = listener
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sel = selectors.DefaultSelector()
    for kind, listener in listeners.items():
        sel.register(listener, selectors.EVENT_READ, kind)
    sel.register(sys.stdin, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sys.stdin:                    # the test process closed our stdin: it is gone
                if not sys.stdin.buffer.read1(1):
                    return
                continue
            conn, _ = key.fileobj.accept()
            if os.fork() == 0:
                sel.close()
                for listener in listeners.values():
                    listener.close()
                if key.data == "rank":
                    _keep(conn)                             # never returns
                _command(conn, _rank_socket(path))          # never returns
            conn.close()


def _command(conn: socket.socket, rank_socket: str) -> None:
    """In a fork: run the command of the request on `conn`, then leave with its exit status."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        req = _recv(conn)
        _adopt(req["env"], req["cwd"], [os.open(os.devnull, os.O_RDONLY)]
               + [os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for name in ("stdout", "stderr")])
        fork_ranks(None if os.environ.get(REAL_RANKS) == "1" else rank_socket)
        _send(conn, os.getpid())
        sys.argv = ["specdp", *req["argv"]]
        from specdp_cli.cli import main

        try:
            main()
            code = 0
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = _exit_code(e)
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


def _rank_socket(path: str) -> str:
    """The helper's socket for ranks and launchers, beside its socket for commands at `path`."""
    return path + ".rank"


def _adopt(env: dict, cwd: str, fds: list[int]) -> None:
    """A fork takes on the environment, working folder and standard streams (`fds`: stdin, stdout, stderr, closed
    once in place) of the process it stands for."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None                                 # TMPDIR is read again
    os.chdir(cwd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)


def _exit_code(e: SystemExit) -> int:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def _keep(conn: socket.socket) -> None:
    """In a fork (the keeper): fork the rank or launcher a stand-in asked for (`_stand_in`), tell it the fork's pid,
    then its exit status; kill the fork should the stand-in go first."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)        # the stand-in's stdin, stdout, stderr
        req = _recv(conn)
        pid = os.fork()
        if pid == 0:
            conn.close()
            _become(req, fds)                               # never returns
        for fd in fds:
            os.close(fd)
        _send(conn, pid)
        ended = os.pidfd_open(pid)
        ready = select.select([conn, ended], [], [])[0]
        if ended not in ready:                              # the stand-in is gone (its end of the link closed)
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if ended in ready:
            _send(conn, os.waitstatus_to_exitcode(status))  # -N: killed by signal N
        code = 0
    finally:
        os._exit(code)


def _become(req: dict, fds: list[int]) -> None:
    """In the keeper's fork: become the rank (`python -m specdp_cli.rank RUN_DIR`) or the launcher (`python -m
    accelerate.commands.launch OPTIONS`) as started where the stand-in was."""
    code = 1
    try:
        os.setsid()           # a launched rank runs in a session of its own; so does the launcher (the command's)
        _adopt(req["env"], req["cwd"], fds)
        sys.argv = [os.path.abspath(__file__), *req["argv"]]
        if req["kind"] == "rank":
            from specdp_cli.rank import main

            main(req["argv"])                               # leaves the process itself
        else:
            import runpy

            try:
                runpy.run_module("accelerate.commands.launch", run_name="__main__")
                code = 0
            except SystemExit as e:
                code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - in the process's stderr, as an uncaught error would be
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _stand_in(kind: str, argv: list[str]) -> None:
    """`python tests/cli_forks.py --rank RUN_DIR` or `--launcher OPTIONS`, started where a rank or the launcher would
    be: the helper forks it; this process passes on the signals it gets and leaves as the fork did."""
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(os.environ[RANK_SOCKET])
    socket.send_fds(sock, [b"R"], [0, 1, 2])
    _send(sock, {"kind": kind, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()})
    pid = _recv(sock)

    def pass_on(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, pass_on)
    code = _recv(sock)
    if code is None:                                        # the keeper is gone: as a process killed outright
        code = -signal.SIGKILL
    if code < 0:                                            # the fork was killed by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    if sys.argv[1] in ("--rank", "--launcher"):
        _stand_in(sys.argv[1][2:], sys.argv[2:])
    sys.path[0] = os.getcwd()                      # as `python -m specdp_cli` run here has it (not tests/)
    _serve(sys.argv[1])
