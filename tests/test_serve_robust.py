"""The server survives its clients (dp = 2 on CPU, in both dp_sync modes: never serving without drafts and with
async scheduling, always with a draft model): hang-ups mid-stream,
lockstep hang-ups of short requests, hostile numbers and bodies, a bug in a handler, and a fuzz run
driven by the server's own /openapi.json. After each storm /health is 200 and a greedy completion
still equals `specdp generate`'s output."""
import http.client
import json
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dp_util import write_jsonl
from specdp_cli.cli import app
from test_serve import KEY, free_port, server_config, start_server_ahead

pytestmark = pytest.mark.timeout(300)
PROMPTS = ["def add(a, b):", "for i in range(10):"]
TIMEOUT_S = 4          # the servers' collective_timeout_s: the lockstep test waits past it


@pytest.fixture(scope="module", autouse=True)
def servers_ahead(request, tmp_path_factory, models, launches) -> dict:
    """The server of each dp_sync mode that this session's tests use, started when this module starts: the second
    comes up while the first one's tests run. {mode: (its directory, its config)}."""
    modes = {item.callspec.params["server"] for item in request.session.items
             if item.module is request.module and "server" in getattr(getattr(item, "callspec", None), "params", {})}
    out = {}
    for mode in ("never", "always"):
        if mode in modes:
            tmp, port = tmp_path_factory.mktemp(f"robust-{mode}"), free_port()
            # dp_sync never serves without drafts, with async scheduling: aborts and disconnects land while a step
            # planned ahead of the last one's tokens is on the way
            plain = ({"speculative": {"method": "none"}, "scheduler": {"async_scheduling": True}}
                     if mode == "never" else {})
            cfg = server_config(tmp, models, port, parallel={"dp_sync": mode, "collective_timeout_s": TIMEOUT_S},
                                **plain)
            # ranks launched as `specdp serve` launches them (not cli_forks' forks): the tests below signal them
            start_server_ahead(request, launches, mode, cfg, port, SPECDP_TEST_REAL_RANKS="1")
            out[mode] = (tmp, cfg)
    return out


@pytest.fixture(scope="module", params=["never", "always"])
def server(request, models, servers_ahead, launches):
    tmp, cfg = servers_ahead[request.param]
    s = launches.result(request.param)
    s.models = models
    inp = write_jsonl(tmp / "in.jsonl", [{"prompt": p, "max_tokens": 12} for p in PROMPTS])
    res = CliRunner().invoke(app, ["generate", str(cfg), "--input", str(inp), "--output", str(tmp / "o.jsonl"),
                                   "--dp", "1"])
    assert res.exit_code == 0, res.output
    s.expected = [json.loads(x)["text"] for x in open(tmp / "o.jsonl")]
    yield s
    s.stop()


def assert_still_serving(server):
    deadline = time.monotonic() + 60
    while server.metric("specdp:num_requests_running") > 0:      # aborted requests leave their slots
        assert time.monotonic() < deadline, "requests stayed running after their clients left"
        time.sleep(0.2)
    assert server.health() == 200
    got = []
    for p in PROMPTS:
        code, text, _ = server.http("POST", "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0})
        assert code == 200, text
        got.append(json.loads(text)["choices"][0]["text"])
    assert got == server.expected
    assert server.proc.poll() is None


def open_stream(server, body, path="/v1/completions"):
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    c.request("POST", path, body=json.dumps({**body, "stream": True}),
              headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    return c, r


def hang_up(c):
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()


def run_all(fns):
    errors = []

    def guard(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=guard, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


def test_disconnect_storm(server):
    """16 concurrent streams; half of the clients hang up after the first event, half read to the end."""
    done = []

    def client(i):
        def go():
            c, r = open_stream(server, {"prompt": PROMPTS[i % 2] + " " * (i % 3), "max_tokens": 40,
                                        "temperature": 0.7 if i % 4 else 0, "seed": i})
            r.fp.readline()
            if i % 2:
                hang_up(c)
                return
            body = b""                  # raw (chunked) bytes: the first line was read raw already
            while b"data: [DONE]" not in body:
                line = r.fp.readline()
                assert line, body[-300:]
                body += line
            c.close()
            assert b'"error"' not in body and b'"finish_reason": "' in body, body[-300:]
            done.append(i)
        return go

    run_all([client(i) for i in range(16)])
    assert len(done) == 8
    assert_still_serving(server)


def test_short_requests_hung_up_after_the_first_event(server):
    """Chat streams of 2-4 tokens whose clients leave after the first event (the role chunk, sent
    before any token): the abort often reaches a rank that has finished the request and gone idle.
    In lockstep every rank must step for it, or one steps alone; wait past collective_timeout_s,
    when a lone rank would have failed."""
    def client(i):
        def go():
            c, r = open_stream(server, {"messages": [{"role": "user", "content": PROMPTS[i % 2]}],
                                        "max_tokens": 2 + i % 3}, "/v1/chat/completions")
            r.fp.readline()
            hang_up(c)
        return go

    for i in range(8):                 # one at a time: an abort then reaches one idle rank, the other has nothing
        client(i)()
    run_all([client(i) for i in range(6)])
    time.sleep(TIMEOUT_S + 2)          # the scenario itself: nothing may be left waiting in a collective
    assert_still_serving(server)


RAW_BODIES = [
    ("/v1/completions", '{"prompt": "x", "temperature": 0.7, "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", '{"prompt": "x", "seed": -9223372036854775809}', "seed"),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "temperature": Infinity}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_p": NaN}', "top_p"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1e400}', "max_tokens"),
    ("/v1/completions", "[" * 100_000, None),
    ("/v1/completions", '{"prompt": "abc\\ud800"}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "abc\\ud800"}]}', "messages"),
]


@pytest.mark.parametrize("path,raw,param", RAW_BODIES)
def test_hostile_numbers_and_bodies_get_openai_400s(server, path, raw, param):
    code, text, _ = server.http("POST", path, raw=raw)
    assert code == 400, text
    err = json.loads(text)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert server.health() == 200


def test_wrong_method_is_a_client_error(server):
    code, text, _ = server.http("GET", "/v1/completions")
    assert code == 405 and json.loads(text)["error"]["type"] == "invalid_request_error"


def test_openapi_lists_the_endpoints(server):
    code, text, _ = server.http("GET", "/openapi.json", headers={"Authorization": ""})
    assert code == 200
    paths = json.loads(text)["paths"]
    for p, field in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
        schema = paths[p]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert field in schema["required"] and "seed" in schema["properties"]
        # exactly what is honoured, and the fields accepted only at one value: nothing else
        assert schema["additionalProperties"] is False
        assert {"stop_token_ids", "ignore_eos", "presence_penalty", "logit_bias", "min_p", "min_tokens",
                "structured_outputs", "response_format", "logprobs"} <= set(schema["properties"])
        assert schema["properties"]["presence_penalty"]["maximum"] == 2
        assert schema["properties"]["best_of"]["enum"] == [1]


def _value(schema: dict):
    """Values for one property of the published schema: conforming ones, edge values, and any JSON."""
    anything = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                            max_leaves=6)
    if "anyOf" in schema:
        return st.one_of(*[_value(s) for s in schema["anyOf"]], anything)
    t = schema.get("type")
    if t == "integer":
        lo, hi = schema.get("minimum", -(2 ** 70)), min(schema.get("maximum", 2 ** 70), 24)
        return st.one_of(st.integers(lo, max(lo, hi)), st.integers(), anything)
    if t == "number":
        return st.one_of(st.floats(schema.get("minimum", -3), schema.get("maximum", 3)), st.floats(), anything)
    if t == "string":
        return st.one_of(st.sampled_from(schema["enum"]) if "enum" in schema else st.text(max_size=30), anything)
    if t == "boolean":
        return st.one_of(st.booleans(), anything)
    if t == "array":
        return st.one_of(st.lists(_value(schema.get("items", {})), max_size=3), anything)
    if t == "object" and "properties" in schema:
        return st.one_of(st.fixed_dictionaries({}, optional={k: _value(v) for k, v in schema["properties"].items()}),
                         anything)
    return anything


@pytest.fixture(scope="module")
def bodies(server):
    spec = json.loads(server.http("GET", "/openapi.json")[1])
    out = []
    for path in ("/v1/completions", "/v1/chat/completions"):
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        props = {k: _value(v) for k, v in schema["properties"].items() if k != "model"}
        required = {k: props.pop(k) for k in schema["required"]}
        out.append(st.tuples(st.just(path), st.fixed_dictionaries(required, optional=props)))
    return st.one_of(*out)


def test_schema_driven_fuzz_finds_no_5xx(server, bodies):
    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def one(case):
        path, body = case
        code, text, _ = server.http("POST", path, raw=json.dumps(body))
        assert code < 500, (body, code, text)
        if code >= 400:
            assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}

    one()
    assert_still_serving(server)


def test_a_bug_in_a_handler_is_an_openai_500_and_serving_goes_on(models):
    """In process: a frontend whose submit raises. The client gets an OpenAI-shaped 500, the next
    request is served."""
    from fastapi.testclient import TestClient

    from specdp_cli.config import SamplingConfig
    from specdp_cli.modeldir import load_tokenizer
    from specdp_cli.prompts import PromptEncoder
    from specdp_cli.server.app import build_app

    class Broken:
        def submit(self, req):
            raise RuntimeError("a bug")

    tok = load_tokenizer(str(models["tokenizer"]))
    api = build_app(Broken(), PromptEncoder(tok), tok, "tiny", 96, SamplingConfig(), None)
    client = TestClient(api, raise_server_exceptions=False)
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "RuntimeError" in r.json()["error"]["message"]
    assert client.get("/v1/models").status_code == 200


def test_a_long_prompt_is_tokenized_off_the_event_loop(models):
    """In process: a request body from ENCODE_OFF_LOOP_BYTES on is parsed and its prompt tokenized on the API
    server's encoding thread (the tokenizer releases the GIL: the event loop goes on streaming), a short one on the
    event loop; both reach the frontend as the same request would."""
    import threading

    from fastapi.testclient import TestClient

    from specdp_cli.config import SamplingConfig
    from specdp_cli.modeldir import load_tokenizer
    from specdp_cli.prompts import PromptEncoder
    from specdp_cli.server.app import ENCODE_OFF_LOOP_BYTES, build_app
    from specdp_cli.server.protocol import APIError

    where, submitted = {}, []

    class Recording(PromptEncoder):
        def encode_text(self, text):
            where[len(text)] = threading.current_thread().name
            return super().encode_text(text)

    class Frontend:
        def submit(self, req):
            submitted.append(req)
            raise APIError(503, "no ranks here")

    tok = load_tokenizer(str(models["tokenizer"]))
    api = build_app(Frontend(), Recording(tok), tok, "tiny", 1 << 20, SamplingConfig(), None)
    client = TestClient(api, raise_server_exceptions=False)
    short, long = "def f(x):\n", "def f(x):\n" * (ENCODE_OFF_LOOP_BYTES // 10 + 1)
    for text in (short, long):
        r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
        assert r.status_code == 503, r.text
    assert not where[len(short)].startswith("specdp-encode") and where[len(long)].startswith("specdp-encode"), where
    assert submitted[1].prompt_ids == tok(long)["input_ids"] and submitted[0].prompt_ids == tok(short)["input_ids"]
    r = client.post("/v1/completions", json={"prompt": long, "max_tokens": 2, "top_p": 7})     # errors still 4xx
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"


def test_one_schema_same_error_text_from_generate_and_serve(server, tmp_path):
    """The server and a `generate` job check requests with the same code: the same bad request gets
    the same sentence (generate prefixes the line number)."""
    bad = [{"prompt": "x", "temperature": 0.7, "seed": 2 ** 64}, {"prompt": "x", "top_k": -2},
           {"prompt": "x", "top_p": 1.5}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "stop": [1]}]
    inp = write_jsonl(tmp_path / "bad.jsonl", bad)
    out = tmp_path / "o.jsonl"
    cfg = server_config(tmp_path, server.models, free_port())
    res = CliRunner().invoke(app, ["generate", str(cfg), "--input", str(inp), "--output", str(out), "--dp", "1"])
    assert res.exit_code == 0, res.output
    job_errors = [json.loads(x)["error"] for x in open(out)]
    for i, body in enumerate(bad):
        code, text, _ = server.http("POST", "/v1/completions", body)
        assert code == 400
        assert job_errors[i] == f"line {i + 1}: " + json.loads(text)["error"]["message"]


def test_a_busy_port_is_refused_before_any_work(tmp_path, models):
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = server_config(tmp_path, models, port)
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "specdp_cli", "serve", str(cfg)], capture_output=True, text=True,
                           timeout=60)
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "serving" not in r.stderr and time.monotonic() - t < 30


# Last: each ends the module's server of its dp_sync mode (pytest runs a module-scoped fixture's tests by parameter,
# in the file's order), which saves starting a server of its own.

@pytest.mark.parametrize("server", ["never"], indirect=True)
def test_a_frozen_rank_is_reported_unresponsive(server):
    """SIGSTOP on a rank: the other rank stops hearing its heartbeat within collective_timeout_s, the
    server answers 503 and exits 1, and the message says the frozen rank is unresponsive, not killed."""
    import signal as sig

    s = server
    try:
        frozen = [p for p in s.ranks() if "specdp_cli.rank" in " ".join(p.cmdline())]
        assert len(frozen) == 2
        frozen = sorted(frozen, key=lambda p: p.pid)[1]
        frozen.send_signal(sig.SIGSTOP)
        assert s.proc.wait(60) == 1
        err = s.proc.stderr.read()
        assert "is unresponsive" in err and "stopped (SIGSTOP" in err, err[-2000:]
    finally:
        try:
            frozen.send_signal(sig.SIGCONT)
        except Exception:  # noqa: BLE001 - already gone
            pass


@pytest.mark.parametrize("server", ["always"], indirect=True)
def test_killed_rank_turns_health_503_and_exits_1(server):
    """A rank killed: /health turns 503 and the server exits 1 within collective_timeout_s + 30 s."""
    s = server
    ranks = s.ranks()
    assert len(ranks) == 2
    t0 = time.monotonic()
    ranks[1].kill()
    saw_503 = False
    while s.proc.poll() is None and time.monotonic() - t0 < TIMEOUT_S + 30:
        if s.health() == 503:
            saw_503 = True
        time.sleep(0.1)
    assert saw_503
    assert s.proc.wait(5) == 1
    assert time.monotonic() - t0 < TIMEOUT_S + 30
