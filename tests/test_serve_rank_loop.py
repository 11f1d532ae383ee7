"""A serving rank's loop (server/rank.py) over a stand-in engine: each step's tokens reach the frontend (sent
while the next step runs, at once when the step is still on the device (async scheduling) or when none follows),
a message that arrived during a step is taken at the next one, and an idle rank waits on its links instead of
spinning."""
import contextlib
import os
import socket
import stat
import tempfile
import threading
from multiprocessing.connection import Listener
from types import SimpleNamespace

from specdp_cli.runtime.engine import RankCounters
from specdp_cli.server.link import RankLink, local_link_spec, new_link_spec, recv_message, send_message
from specdp_cli.server.rank import serve_rank


class OneTokenEngine:
    """Each step gives every running request one token; counts how often the loop asks for work once idle."""

    step_in_flight = False          # a step is over when `step` returns (no async scheduling)

    def __init__(self):
        self.running, self.waiting = [], []
        self.scheduler = SimpleNamespace(running=self.running, waiting=self.waiting)
        self.pool = SimpleNamespace(num_free=1, num_blocks=1, queries=0, hits=0)
        self.counters = RankCounters()
        self.spec_len = SimpleNamespace(used={0: 0})
        self.step_no, self.finished, self.idle_checks, self.overlapped = 0, 0, 0, 0

    def stop_followers(self):          # tensor parallelism: none here
        pass

    def make_request(self, req_id, prompt_ids, params, seed, block_hashes=None):
        return SimpleNamespace(id=req_id, left=params.max_tokens, generated=[])

    def add_request(self, req):
        self.waiting.append(req)

    def abort(self, req_id):
        for q in (self.running, self.waiting):
            for r in q:
                if r.id == req_id:
                    q.remove(r)
                    return True
        return False

    @property
    def has_work(self):
        if not (self.running or self.waiting) and self.finished:
            self.idle_checks += 1
        return bool(self.running or self.waiting)

    def step(self, received=0, while_device_runs=None):
        self.running += self.waiting
        self.waiting.clear()
        self.step_no += 1
        if while_device_runs is not None:        # as the engine does, while "the device runs" this step
            self.overlapped += 1
            while_device_runs()
        self.spec_len.used[0] += 1
        outs = []
        for r in list(self.running):
            r.left -= 1
            r.generated.append(7)
            done = r.left == 0
            if done:
                self.running.remove(r)
                self.finished += 1
            seq = SimpleNamespace(req=r, finish_reason="length" if done else None, error=None, stop_text_end=None,
                                  arrived_t=0.0, scheduled_t=0.0, first_token_t=0.0,
                                  num_prompt=1, generated=r.generated, preemptions=0,
                                  stats=SimpleNamespace(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0,
                                                        accepted_per_pos=[]))
            outs.append(SimpleNamespace(seq=seq, new_tokens=[7], finished=done, logprobs=None))
        return outs


class AsyncStandIn(OneTokenEngine):
    """As the engine with async scheduling: `step` returns while its step is still "on the device". Step n + 1
    (before its device work) waits for the test to have read step n's tokens, and may send the frontend a message
    from inside a step (as one arriving while a step runs)."""

    step_in_flight = True

    def __init__(self, seen, during_step=None):
        super().__init__()
        self.seen, self.during_step, self.late, self.added_at = seen, during_step, [], {}

    def add_request(self, req):
        self.added_at[req.id] = self.step_no
        super().add_request(req)

    def step(self, received=0, while_device_runs=None):
        if self.step_no and not self.seen[self.step_no].wait(5):
            self.late.append(self.step_no)        # step n's tokens had not gone out when step n + 1 began
        if self.during_step is not None:
            self.during_step(self.step_no + 1)
        return super().step(received, while_device_runs)


def _read_tokens(conn, seen, until_finished: int) -> dict:
    """Read the rank's messages, setting seen[n] as the n-th step's tokens arrive, until `until_finished` requests
    finished: {id: tokens}."""
    got, steps, finished = {}, 0, 0
    while finished < until_finished:
        assert conn.poll(30), "the rank stopped answering"
        msg = recv_message(conn)
        assert msg[0] == "out"
        if msg[1]:
            steps += 1
            seen[steps].set()
        for rid, new, fin, *_ in msg[1]:
            got[rid] = got.get(rid, []) + new
            finished += fin is not None
    return got


def test_async_steps_tokens_go_out_before_the_next_step():
    """With the step still on the device when `engine.step` returns, its tokens go out at once, not a step later:
    a step later costs every token (and a finished request's replacement) one step of latency."""
    seen = [threading.Event() for _ in range(64)]
    engine = AsyncStandIn(seen)
    conn, rank = _rank_over_link(engine)
    params = {"max_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
    send_message(conn, ("add", "r1", [1, 2, 3], params, None, b""))
    assert _read_tokens(conn, seen, 1) == {"r1": [7] * 6}
    send_message(conn, ("shutdown",))
    assert conn.poll(30) and recv_message(conn) == ("bye", 0)
    rank.join(30)
    assert engine.late == []


def test_a_message_arriving_during_a_step_is_taken_at_the_next():
    """The links are read at the start of each step, on the loop's thread: a request that arrived during step n is
    added before step n + 1 (a reader thread waited for the GIL, held by the step loop, up to 5 ms: many steps)."""
    seen = [threading.Event() for _ in range(64)]
    params = {"max_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
    frontend = []

    def during_step(n):
        if n == 3:
            send_message(frontend[0], ("add", "r2", [4], params, None, b""))
            busy = 0
            for i in range(20_000):            # the rest of the step (~1 ms): Python holding the GIL
                busy += i

    engine = AsyncStandIn(seen, during_step)
    conn, rank = _rank_over_link(engine)
    frontend.append(conn)
    send_message(conn, ("add", "r1", [1, 2, 3], params, None, b""))
    assert _read_tokens(conn, seen, 2) == {"r1": [7] * 6, "r2": [7] * 6}
    send_message(conn, ("shutdown",))
    assert conn.poll(30) and recv_message(conn) == ("bye", 0)
    rank.join(30)
    assert engine.added_at["r2"] == 3, engine.added_at


def _rank_over_link(engine):
    """A serving rank's loop over `engine` in a thread, linked to this test as its frontend: (link, thread)."""
    spec = new_link_spec("127.0.0.1")
    listener = Listener(("127.0.0.1", 0), authkey=bytes.fromhex(spec["authkey"]))
    spec["port"] = listener.address[1]
    dp = SimpleNamespace(lockstep=False, rank=0, publish=lambda *a: None)
    rank = threading.Thread(target=serve_rank, args=(engine, dp, {"links": [spec]}), daemon=True)
    rank.start()
    conn = listener.accept()
    assert recv_message(conn) == ("hello", 0)
    return conn, rank


def test_every_step_reaches_the_frontend_and_an_idle_rank_waits():
    engine = OneTokenEngine()
    conn, rank = _rank_over_link(engine)
    params = {"max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
    send_message(conn, ("add", "r1", [1, 2, 3], params, None, b""))
    tokens, finish = [], None
    while finish is None:
        assert conn.poll(30), "a step's tokens never reached the frontend"
        msg = recv_message(conn)
        assert msg[0] == "out"
        for rid, new, fin, *_ in msg[1]:
            assert rid == "r1"
            tokens += new
            finish = fin
    assert tokens == [7] * 5 and finish == "length"
    assert engine.overlapped == 5        # each step's tokens went out from the next step or once idle
    send_message(conn, ("shutdown",))
    assert conn.poll(30) and recv_message(conn) == ("bye", 0)
    rank.join(30)
    assert not rank.is_alive()
    # once idle, the loop asked for work a bounded number of times before it blocked (a spinning loop asks on and on)
    assert engine.idle_checks <= 4, engine.idle_checks


def test_an_abort_answer_follows_the_tokens_sent_before_it():
    """A step's tokens wait for the next step to go out; an abort's answer must not overtake them (the frontend
    would see tokens of a finished request)."""
    engine = OneTokenEngine()
    conn, rank = _rank_over_link(engine)
    params = {"max_tokens": 10**6, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
    send_message(conn, ("add", "r1", [1, 2, 3], params, None, b""))
    assert conn.poll(30) and recv_message(conn)[0] == "out"          # it runs
    send_message(conn, ("abort", "r1"))
    send_message(conn, ("shutdown",))
    after_abort = None
    while True:
        assert conn.poll(30), "the rank stopped answering"
        msg = recv_message(conn)
        if msg == ("bye", 0):
            break
        for rid, new, fin, *_ in msg[1]:
            if after_abort is not None:
                after_abort.append((rid, new, fin))
            if fin == "abort":
                after_abort = []
    assert after_abort == [], after_abort
    rank.join(30)
    assert not rank.is_alive()


def _nodelay(fd: int) -> int:
    sock = socket.socket(fileno=os.dup(fd))
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()


def _socket_fd_at(address) -> int | None:
    """This process's socket whose local address is `address` (the link's other end, here in a thread)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue                           # not a socket
        try:
            if sock.family == socket.AF_INET and sock.getsockname() == address:
                return int(name)
        except OSError:
            pass
        finally:
            sock.close()
    return None


def test_both_ends_of_the_link_send_at_once():
    """TCP_NODELAY on the frontend's and the rank's side: with Nagle's algorithm a step's message sent while
    the previous one is unacknowledged waited for the peer's delayed ACK, up to 40 ms."""
    link = RankLink(1, new_link_spec("127.0.0.1"), lambda *a: None, lambda *a: None)
    with _rank_linked(link):
        frontend_fd = link.conns[0].fileno()
        assert _nodelay(frontend_fd) == 1
        peer = socket.socket(fileno=os.dup(frontend_fd))
        rank_address = peer.getpeername()
        peer.close()
        rank_fd = _socket_fd_at(rank_address)
        assert rank_fd is not None, "the rank's end of the link was not found"
        assert _nodelay(rank_fd) == 1


@contextlib.contextmanager
def _rank_linked(link):
    """A serving rank's loop over `link` (a RankLink) in a thread, connected; shut down and the link closed after."""
    dp = SimpleNamespace(lockstep=False, rank=0, publish=lambda *a: None)
    rank = threading.Thread(target=serve_rank, args=(OneTokenEngine(), dp, {"links": [link.spec]}), daemon=True)
    rank.start()
    try:
        assert link.wait_connected(30), "the rank did not connect"
        yield
    finally:
        link.send(0, ("shutdown",))
        rank.join(30)
        link.close()
    assert not rank.is_alive()


def _three_tokens_over(link) -> int:
    """A request of 3 tokens through `link` to a serving rank's loop (`_rank_linked`): the family of the frontend's
    end of the link."""
    with _rank_linked(link):
        conn = link.conns[0]
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            family = sock.family
        params = {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
        assert link.send(0, ("add", "r1", [1, 2, 3], params, None, b""))
        tokens, finish = [], None
        while finish is None:
            assert conn.poll(30), "a step's tokens never reached the frontend"
            for rid, new, fin, *_ in recv_message(conn)[1]:
                tokens, finish = tokens + new, fin
        assert (tokens, finish) == ([7] * 3, "length")
    return family


def test_a_local_link_is_a_unix_socket_and_closing_it_removes_the_socket():
    """Ranks on the frontend's machine link to it over a Unix socket (`local_link_spec`): requests and tokens travel
    as over TCP, and the socket's file goes with the link."""
    link = RankLink(1, local_link_spec(), lambda *a: None, lambda *a: None)
    path = link.spec["path"]
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert _three_tokens_over(link) == socket.AF_UNIX
    assert not os.path.exists(os.path.dirname(path))


def test_a_local_link_takes_tcp_where_a_socket_path_would_be_too_long(tmp_path, monkeypatch):
    """A temporary directory too deep for a Unix socket's path (at most 107 bytes): the link listens on loopback TCP."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    link = RankLink(1, local_link_spec(), lambda *a: None, lambda *a: None)
    assert "unix" not in link.spec and link.spec["port"] > 0
    assert _three_tokens_over(link) == socket.AF_INET
    assert os.listdir(deep) == []


def test_each_api_server_gets_its_own_requests_tokens():
    """Two links (two API server processes): a request's tokens and its end go back over the link it came in on,
    the rank's state (/metrics) over the first only, and both links get the rank's goodbye."""
    listeners, specs = [], []
    for _ in range(2):
        spec = new_link_spec("127.0.0.1")
        listener = Listener(("127.0.0.1", 0), authkey=bytes.fromhex(spec["authkey"]))
        specs.append({**spec, "port": listener.address[1]})
        listeners.append(listener)
    engine = OneTokenEngine()
    dp = SimpleNamespace(lockstep=False, rank=0, publish=lambda *a: None)
    rank = threading.Thread(target=serve_rank, args=(engine, dp, {"links": specs}), daemon=True)
    rank.start()
    conns = []
    for listener in listeners:
        conns.append(listener.accept())
        assert recv_message(conns[-1]) == ("hello", 0)
    params = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
    send_message(conns[0], ("add", "a", [1], params, None, b""))
    send_message(conns[1], ("add", "b", [2], params, None, b""))
    send_message(conns[1], ("add", "c", [3], params, None, b""))
    got = [{}, {}]
    with_state = [0, 0]
    for api, conn in enumerate(conns):
        while sum(fin is not None for _, fin in got[api].values()) < (1, 2)[api]:
            assert conn.poll(30), f"API server {api} stopped hearing from the rank"
            msg = recv_message(conn)
            assert msg[0] == "out"
            with_state[api] += len(msg) > 2
            for rid, new, fin, *_ in msg[1]:
                tokens, _ = got[api].get(rid, ([], None))
                got[api][rid] = (tokens + new, fin)
    assert got == [{"a": ([7] * 4, "length")}, {"b": ([7] * 4, "length"), "c": ([7] * 4, "length")}]
    assert with_state[0] > 0 and with_state[1] == 0
    send_message(conns[0], ("shutdown",))
    for conn in conns:
        while True:
            assert conn.poll(30), "no goodbye"
            if recv_message(conn) == ("bye", 0):
                break
    rank.join(30)
    assert not rank.is_alive()


def test_the_rank_state_rides_on_a_step_now_and_then_and_on_the_last(monkeypatch):
    """The rank's state for /metrics goes out with a step's tokens at most every STATE_EVERY_S while it has work
    (building, sending and reading it every step cost the rank's loop and the frontend), and always with the step
    after which it has none; the steps per k add up over those messages."""
    from specdp_cli.server import rank as rank_mod

    monkeypatch.setattr(rank_mod, "STATE_EVERY_S", 3600.0)     # only the first step's and the last one's
    engine = OneTokenEngine()
    conn, rank = _rank_over_link(engine)
    params = {"max_tokens": 50, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
    send_message(conn, ("add", "r1", [1, 2, 3], params, None, b""))
    states, steps_by_k, tokens, finish = [], {}, 0, None
    while finish is None:
        assert conn.poll(30), "the rank stopped answering"
        msg = recv_message(conn)
        assert msg[0] == "out"
        if len(msg) > 2:
            states.append((msg[3], finish))
            for k, n in msg[2].items():
                steps_by_k[k] = steps_by_k.get(k, 0) + n
        for rid, new, fin, *_ in msg[1]:
            tokens += len(new)
            finish = fin
    assert tokens == 50 and len(states) == 2, len(states)
    assert states[-1][0][:2] == (0, 0)          # sent with the last tokens: nothing running or waiting after them
    assert steps_by_k == {0: 50}
    send_message(conn, ("shutdown",))
    assert conn.poll(30) and recv_message(conn) == ("bye", 0)
    rank.join(30)


def test_the_rank_state_carries_the_process_collections_and_metrics_adds_them():
    """A rank's state ends with its process's garbage collections since start-up and their seconds
    (runtime/heap.py), which /metrics adds up per rank as it does the other totals."""
    import gc

    from specdp_cli.runtime import heap
    from specdp_cli.server.metrics import Metrics, parse_prometheus
    from specdp_cli.server.rank import _state

    heap.freeze_startup_heap()               # counting from here, as a rank does after its start-up
    try:
        gc.collect()
        gc.collect()
        state = _state(OneTokenEngine(), 0.5, 0.25)
    finally:
        heap.thaw_heap()
    collections, pause_s = state[-2:]
    assert collections >= 2 and pause_s > 0
    metrics = Metrics("tiny", 1, 256)
    metrics.rank_report(0, {}, state)
    metrics.rank_report(0, {}, state[:-2] + (collections + 3, pause_s + 0.5))      # totals: only the increase adds
    shown = parse_prometheus(metrics.render(1).decode())
    assert shown['specdp:rank_gc_collections_total{engine="0",model_name="tiny"}'] == collections + 3
    assert abs(shown['specdp:rank_gc_pause_seconds_total{engine="0",model_name="tiny"}'] - (pause_s + 0.5)) < 1e-9


def test_a_message_split_across_reads_is_taken_whole():
    """The rank reads what has arrived on a link and parses whole messages out of it: a message whose second half
    arrives later is taken once it is whole, by an idle rank waiting on its links."""
    import marshal
    import struct

    engine = OneTokenEngine()
    conn, rank = _rank_over_link(engine)
    params = {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
    payload = marshal.dumps(("add", "r1", [1, 2, 3], params, None, b""))
    frame = struct.pack("!i", len(payload)) + payload
    os.write(conn.fileno(), frame[:7])
    assert not conn.poll(0.2)                   # half a message: nothing runs
    os.write(conn.fileno(), frame[7:])
    got = []
    while len(got) < 3:
        assert conn.poll(30), "the rank never took the message"
        got += [t for _, new, *_ in recv_message(conn)[1] for t in new]
    assert got == [7, 7, 7]
    send_message(conn, ("shutdown",))
    assert conn.poll(30) and recv_message(conn) == ("bye", 0)
    rank.join(30)


def test_a_request_goes_in_marshal_without_references():
    """A request goes over the link in marshal's version 2: from version 3 on, marshal notes every value that may
    recur in a table, one entry per prompt token, which cost the frontend 2-4x the encoding
    (benchmarks/link_codec.py --prompt 1500). It arrives as sent; the steps' messages keep the current version."""
    import marshal
    from multiprocessing import Pipe

    a, b = Pipe()
    parsed = [(i * 7919) % 5000 for i in range(1500)]      # the body's list, held while its copy goes out
    msg = ("add", "r1", list(parsed), {"max_tokens": 3, "temperature": 0.0}, None, bytes(range(64)))
    send_message(a, msg)
    raw = b.recv_bytes()
    assert raw == marshal.dumps(msg, 2) and raw != marshal.dumps(msg)
    assert marshal.loads(raw) == msg
    step = ("out", [("r1", [5, 6], None, None, None, None)])
    send_message(a, step)
    assert b.recv_bytes() == marshal.dumps(step)
    a.close()
    b.close()
