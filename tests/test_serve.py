"""`specdp serve` with dp = 2 on CPU, driven by the real `openai` client over a live port."""
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import threading
import time

import openai
import psutil
import pytest
import torch
from typer.testing import CliRunner

from cli_forks import FORKS
from dp_util import write_jsonl
from helpers import write_config
from specdp_cli.cli import app
from specdp_cli.server.metrics import parse_prometheus

pytestmark = pytest.mark.timeout(300)
KEY = "sk-test-key"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_config(tmp, models, port, **extra):
    data = {"model": str(models["target"]), "max_model_len": 96, "device": "cpu", "chat_template": TEMPLATE,
            "speculative": {"model": str(models["draft"]), "num_speculative_tokens": 3},
            "parallel": {"data_parallel_size": 2, "dp_sync": "always", "collective_timeout_s": 20},
            "scheduler": {"max_num_seqs": 4}, "sampling": {"max_tokens": 16},
            "server": {"port": port, "model_name": "tiny", "max_queue": 20, "api_key": KEY}}
    for k, v in extra.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    return write_config(tmp / "serve.yaml", data)


class Server:
    def __init__(self, cfg, port, environ=None):
        """`specdp serve cfg` on `port`, once it answers; `environ`: its environment (default: this process's)."""
        self.port = port
        env = dict(os.environ if environ is None else environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
        env.pop("SPECDP_API_KEY", None)
        self.proc = FORKS.start(["serve", str(cfg)], env, os.getcwd())      # as `python -m specdp_cli serve cfg`
        deadline = time.monotonic() + 120
        while self.health() != 200:
            assert self.proc.poll() is None, self.proc.communicate()
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.3)

    def http(self, method, path, body=None, headers=None, raw=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        text = r.read().decode()
        c.close()
        return r.status, text, dict(r.getheaders())

    def health(self):
        try:
            return self.http("GET", "/health")[0]
        except OSError:
            return None

    def metrics(self):
        _, text, _ = self.http("GET", "/metrics", headers={"Authorization": ""})
        return parse_prometheus(text)

    def metric(self, name, **labels):
        """The sum of the series whose name starts with `name` and whose labels include `labels` (e.g. over
        the ranks)."""
        return sum(v for key, v in self.metrics().items()
                   if key.startswith(name) and labels.items() <= labels_of(key).items())

    def ranks(self):
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if "specdp_cli.rank" in p.cmdline() and p.name() != "pt_elastic"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        if not hasattr(self, "out"):
            self.out, self.err = self.proc.communicate()


def start_server_ahead(request, launches, key, cfg, port, **env) -> None:
    """`Server(cfg, port)` started among `launches` (a fixture's: it comes up while other tests run), with this
    process's environment now plus `env`; `launches.result(key)` is the server once it answers. Stopped when the
    calling fixture ends."""
    launches.start(key, cfg, port, dict(os.environ, **env), fn=Server)

    def stop():
        try:
            server = launches.result(key)
        except Exception:  # noqa: BLE001 - it did not come up: the test that waits for it says so
            return
        server.stop()
    request.addfinalizer(stop)


def labels_of(series: str) -> dict:
    return dict(re.findall(r'(\w+)="([^"]*)"', series))


@contextlib.contextmanager
def serving(tmp, models, ahead=None, **config_extra):
    """A dp-2 server over `server_config(..., **config_extra)`, with what `specdp generate` makes of
    PROMPTS on one rank: yields (complete(prompts=PROMPTS) -> greedy texts, expected texts, Server).
    `ahead`: (config, port, the server) of one started ahead (`start_server_ahead`) over such a config."""
    if ahead is None:
        port = free_port()
        cfg = server_config(tmp, models, port, **config_extra)

        def started():
            return Server(cfg, port)
    else:
        cfg, port, started = ahead
    inp = write_jsonl(tmp / "in.jsonl", [{"prompt": p, "max_tokens": 16} for p in PROMPTS])
    res = CliRunner().invoke(app, ["generate", str(cfg), "--input", str(inp), "--output", str(tmp / "o.jsonl"),
                                   "--dp", "1"])
    assert res.exit_code == 0, res.output
    expected = [json.loads(x)["text"] for x in open(tmp / "o.jsonl")]
    server = started()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)

    def complete(prompts=PROMPTS):
        return [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
                for p in prompts]

    try:
        yield complete, expected, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, models):
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    s = Server(server_config(tmp, models, port), port)
    s.tmp, s.models = tmp, models
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)


PROMPTS = ["def add(a, b):", "class Point:\n    def __init__(self", "for i in range(10):", "import os\nimport sys\n"]


def test_models_and_completions(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].text, str)
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_completion_equals_unstreamed(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=14, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=14, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_streamed_and_not(client):
    msgs = [{"role": "user", "content": "write a loop"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_greedy_server_equals_generate(client, server, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p, "max_tokens": 16} for p in PROMPTS])
    cfg = server_config(tmp_path, server.models, server.port)
    res = CliRunner().invoke(app, ["generate", str(cfg), "--input", str(inp), "--output", str(tmp_path / "o.jsonl"),
                                   "--dp", "1"])
    assert res.exit_code == 0, res.output
    expected = [json.loads(x)["text"] for x in open(tmp_path / "o.jsonl")]
    got = [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
           for p in PROMPTS]
    assert got == expected


def test_sixteen_concurrent_streams(client):
    results, errors = {}, []

    def one(i):
        try:
            s = client.completions.create(model="tiny", prompt=PROMPTS[i % 4] + " " * (i % 3), max_tokens=20,
                                          temperature=0.7, seed=i, stream=True)
            chunks = list(s)
            results[i] = [c for c in chunks if c.choices][-1].choices[0].finish_reason
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 16 and all(v in ("stop", "length") for v in results.values())


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", None, 400, None),                                               # malformed JSON
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 5}, 400, "messages"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 99}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 2, "stream": True}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": -101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(("}}, 400, "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": {}, "regex": "a"}}, 400, "structured_outputs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "priority": 3}, 400, "priority"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": "3"}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", {"prompt": "def f(x): return x\n" * 40}, 400, "prompt"),        # prompt >= M
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
])
def test_bad_inputs(server, path, body, status, param):
    raw = "{not json" if body is None else None
    code, text, _ = server.http("POST", path, body=body, raw=raw)
    assert code == status, text
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert server.health() == 200


def test_what_a_request_asks_with_speculation_on(server, client):
    """Issue 31's client checks, draft model on: greedy logprobs equal transformers' log-softmax at the emitted
    tokens (completions and chat, with top_logprobs), logit_bias -100 on the greedy first token changes it,
    stop_token_ids stops there, a JSON-schema response_format returns JSON that validates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(server.models["target"]))
    model = AutoModelForCausalLM.from_pretrained(str(server.models["target"]), dtype=torch.float32).eval()
    prompt = tok(PROMPTS[0])["input_ids"]
    past_eos = {"ignore_eos": True}                     # ten tokens whatever the tiny model's eos
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                                  extra_body=past_eos)
    lp = r.choices[0].logprobs
    ids = list(prompt)
    with torch.no_grad():                       # transformers' greedy tokens
        for _ in range(r.usage.completion_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    ids = ids[len(prompt):]
    assert lp.tokens == [tok.decode([t]) for t in ids] and len(ids) == 10
    for j, (t, v) in enumerate(zip(ids, lp.token_logprobs)):
        assert abs(v - ref[len(prompt) - 1 + j, t].item()) < 1e-3
        assert max(lp.top_logprobs[j].values()) == v        # greedy: the top (pieces that decode alike share a key)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    streamed = [c for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                                     logprobs=2, stream=True, extra_body=past_eos)
                if c.choices and c.choices[0].logprobs]
    assert sum((c.choices[0].logprobs.token_logprobs for c in streamed), []) == lp.token_logprobs

    biased = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                       logit_bias={str(ids[0]): -100}, logprobs=0, extra_body=past_eos)
    assert biased.choices[0].logprobs.tokens[0] != lp.tokens[0]
    code, text, _ = server.http("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                                            "stop_token_ids": [ids[4]], **past_eos})
    body = json.loads(text)
    assert code == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == ids.index(ids[4]) + 1

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
              "required": ["ok", "color"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for i in range(3):
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[i]}],
                                             max_tokens=40, temperature=0.8, seed=i, response_format=fmt)
        obj = json.loads(out.choices[0].message.content)
        assert set(obj) == {"ok", "color"} and isinstance(obj["ok"], bool) and obj["color"] in ("red", "green")
    choice = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")


def test_n_choices(client):
    """n choices are n requests: greedy ones all equal the single greedy answer; seeded sampled ones are the same
    on a rerun (choice i samples with seed + i), and usage counts every choice's tokens."""
    single = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    one = single.choices[0].text
    greedy = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and all(c.text == one for c in greedy.choices)
    assert greedy.usage.completion_tokens == 3 * single.usage.completion_tokens
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=11, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    seeded = client.completions.create(**{**kw, "n": 1, "seed": 12}).choices[0].text
    assert a.choices[1].text == seeded                                     # choice 1: seed + 1
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          n=2, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[1].message.content


def test_echo_puts_the_prompt_first(server, client):
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    assert echoed.usage == plain.usage
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == echoed.choices[0].text


def test_max_tokens_past_max_model_len_stops_there(server):
    """One length rule with `generate` (DESIGN.md's contract): max_tokens is an upper bound and a sequence also ends
    at max_model_len (96), so prompt + max_tokens > 96 is no error."""
    code, text, _ = server.http("POST", "/v1/completions", {"prompt": list(range(2, 92)), "max_tokens": 200,
                                                            "temperature": 0})
    assert code == 200, text
    body = json.loads(text)
    usage, finish = body["usage"], body["choices"][0]["finish_reason"]
    assert usage["prompt_tokens"] == 90 and (finish == "stop" or usage["prompt_tokens"] + usage["completion_tokens"] == 96)


def test_auth_and_unknown_fields(server, client):
    assert server.http("GET", "/v1/models", headers={"Authorization": ""})[0] == 401
    assert server.http("POST", "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"})[0] == 401
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    code, text, _ = server.http("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "frobnicate": True})
    assert code == 400 and json.loads(text)["error"]["param"] == "frobnicate"            # never accepted and ignored
    neutral = {"prompt": "x", "max_tokens": 2, "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False,
               "logprobs": None, "logit_bias": {}, "user": "someone", "best_of": 1, "suffix": None}
    assert server.http("POST", "/v1/completions", neutral)[0] == 200       # what asks nothing is accepted
    # health and metrics need no key
    assert server.http("GET", "/health", headers={"Authorization": ""})[0] == 200
    assert server.http("GET", "/metrics", headers={"Authorization": ""})[0] == 200


def test_metrics_counters(server, client):
    before = server.metric("specdp:spec_decode_num_draft_tokens_total")
    chunks = server.metric("specdp:steps_with_prompt_chunks_total")
    client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=0)
    assert server.metric("specdp:spec_decode_num_draft_tokens_total") > before
    # specdp's own: the prompt rode in a prompt-chunk wide step; nothing is planned ahead on a CPU
    assert server.metric("specdp:steps_with_prompt_chunks_total") > chunks
    assert server.metric("specdp:steps_planned_ahead_total") == 0
    _, text, _ = server.http("GET", "/metrics")
    for name in ("specdp:spec_decode_num_drafts_total", "specdp:spec_decode_num_accepted_tokens_total",
                 "specdp:time_to_first_token_seconds_bucket", "specdp:request_time_per_output_token_seconds_count",
                 "specdp:prompt_tokens_total", "specdp:generation_tokens_total", "specdp:num_requests_waiting",
                 "specdp:steps_planned_ahead_total", "specdp:rank_gc_collections_total",
                 "specdp:rank_gc_pause_seconds_total", 'finished_reason="length"'):
        assert name in text
    assert any(k.startswith("specdp:spec_decode_num_accepted_tokens_per_pos_total") and labels_of(k)["position"] == "0"
               for k in parse_prometheus(text))
    assert server.metric("specdp:spec_decode_steps_by_k_total", k="3", model_name="tiny") > 0
    # the API server froze its start-up heap (runtime/heap.py) and counts the collections since: a completion's
    # allocations alone start some
    assert server.metric("specdp:api_server_gc_collections_total") > 0
    assert server.metric("specdp:api_server_gc_pause_seconds_total") > 0
    # the ranks' seconds in engine steps: part of their busy seconds, the rest their serving loop's own
    assert 0 < server.metric("specdp:rank_step_seconds_total") < server.metric("specdp:rank_busy_seconds_total")


PER_RANK = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
            "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_count",
            "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count", "request_prompt_tokens_count",
            "request_generation_tokens_count", "request_time_per_output_token_seconds_count",
            "num_preemptions_total", "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
            "request_queue_time_seconds_count", "request_prefill_time_seconds_count",
            "request_decode_time_seconds_count", "request_inference_time_seconds_count")


def test_metrics_are_vllms_per_rank(server, client):
    """vLLM v1's names, suffixes, labels and buckets under `specdp:`, a series per rank (engine="0", "1"), and
    one completion moves its rank's counters by what its usage says."""
    code, text, headers = server.http("GET", "/metrics", headers={"Authorization": ""})
    assert code == 200 and headers["content-type"].startswith("text/plain")
    series = [labels_of(k) | {"name": k.split("{")[0]} for k in parse_prometheus(text)]
    for name in PER_RANK:
        ranks = {s["engine"] for s in series if s["name"] == f"specdp:{name}" and s["model_name"] == "tiny"}
        assert ranks == {"0", "1"}, name
    for name, n, top in (("time_to_first_token_seconds", 22, 2560.0), ("inter_token_latency_seconds", 19, 80.0),
                         ("e2e_request_latency_seconds", 21, 7680.0), ("request_prompt_tokens", 6, 50.0),
                         ("request_queue_time_seconds", 21, 7680.0)):
        assert f"# TYPE specdp:{name} histogram" in text
        les = {s["le"] for s in series if s["name"] == f"specdp:{name}_bucket" and s["engine"] == "1"}
        assert len(les) == n + 1 and max(float(le) for le in les - {"+Inf"}) == top, name   # vLLM's buckets
    for reason in ("stop", "length", "abort", "error"):
        assert f'finished_reason="{reason}"' in text
    assert server.metric("specdp:ranks{") == 2 and server.metric("specdp:ranks_up") == 2
    assert server.metric("specdp:prefix_cache_queries_total") >= server.metric("specdp:prefix_cache_hits_total")
    assert "_created" not in text

    before = server.metrics()
    r = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = server.metrics()

    def delta(name, **labels):
        """Per rank: how much the series of `name` with `labels` moved."""
        return [sum(v - before.get(k, 0) for k, v in after.items()
                    if k.split("{")[0] == f"specdp:{name}" and (labels | {"engine": rank}).items() <= labels_of(k).items())
                for rank in ("0", "1")]

    served = delta("request_success_total", finished_reason="length")
    assert sorted(served) == [0, 1]               # one rank served it, and only its series moved
    rank = served.index(1)
    assert delta("generation_tokens_total")[rank] == r.usage.completion_tokens == 16
    assert delta("prompt_tokens_total")[rank] == r.usage.prompt_tokens
    assert delta("prefix_cache_queries_total")[rank] == r.usage.prompt_tokens      # looked up at admission
    assert delta("request_generation_tokens_sum")[rank] == 16
    assert delta("time_to_first_token_seconds_count") == delta("e2e_request_latency_seconds_count") == served
    assert delta("inter_token_latency_seconds_count")[rank] >= 1
    # the rank's phases of the request: queue + prefill + decode within its end-to-end latency, prefill before TTFT
    phase = {p: delta(f"request_{p}_time_seconds_sum")[rank] for p in ("queue", "prefill", "decode", "inference")}
    assert phase["prefill"] > 0 and phase["decode"] > 0
    assert abs(phase["inference"] - phase["prefill"] - phase["decode"]) < 1e-6
    assert phase["queue"] + phase["prefill"] <= delta("time_to_first_token_seconds_sum")[rank]
    assert sum(phase[p] for p in ("queue", "prefill", "decode")) <= delta("e2e_request_latency_seconds_sum")[rank]
    assert delta("spec_decode_num_draft_tokens_total")[rank] > 0
    assert sum(delta("generation_tokens_total")) == 16
    # the ranks' own report after the request finished: nothing running or waiting, its KV blocks freed
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert [after[k] for k in after if k.startswith(f"specdp:{name}{{")] == [0, 0], name


def test_opt_out_extension_field(server, client):
    """"speculative": false in the body: the same greedy text, and no draft tokens counted for it."""
    spec = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0).choices[0].text
    before = server.metric("specdp:spec_decode_num_draft_tokens_total")
    plain = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                      extra_body={"speculative": False}).choices[0].text
    assert plain == spec
    assert server.metric("specdp:spec_decode_num_draft_tokens_total") == before
    status, text, _ = server.http("POST", "/v1/completions", {"prompt": "x", "speculative": "no"})
    assert status == 400 and "speculative" in text


def test_disconnect_frees_the_slot(server):
    aborts = server.metric("specdp:request_success_total", finished_reason="abort")
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": "def f(x):", "max_tokens": 80, "stream": True,
                                                            "ignore_eos": True}),
              headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    r.fp.readline()                         # the first chunk arrived: the request is running
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    deadline = time.monotonic() + 30
    while server.metric("specdp:request_success_total", finished_reason="abort") == aborts:
        assert time.monotonic() < deadline, "the disconnect did not abort the request"
        time.sleep(0.2)
    while server.metric("specdp:num_requests_running") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert server.health() == 200


def test_a_streams_end_is_one_piece(server):
    """A stream's end (the finish chunk, the usage chunk and [DONE]) is one HTTP chunk, written with the response's
    end: one write to the client, where it took four. Every other chunk is one event."""
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": "def f(x):", "max_tokens": 6, "stream": True,
                                                            "ignore_eos": True,
                                                            "stream_options": {"include_usage": True}}),
              headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.getheader("transfer-encoding") == "chunked"
    pieces = []
    while (size := int(r.fp.readline().split(b";")[0], 16)) > 0:      # the raw chunked body
        pieces.append(r.fp.read(size).decode())
        assert r.fp.read(2) == b"\r\n"
    c.close()
    *events, end = pieces
    assert events and all(e.startswith("data: {") and e.count("\n\n") == 1 for e in events), events
    end_events = end.split("\n\n")
    assert end_events[-2:] == ["data: [DONE]", ""], end
    finish, usage = (json.loads(e[len("data: "):]) for e in end_events[-4:-2])
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["usage"]["completion_tokens"] == 6


def test_queue_limit_gives_429(server):
    statuses, retry = [], []
    together = threading.Barrier(40)          # all 40 arrive at once, however slowly threads start

    def one():
        together.wait(60)
        code, _, headers = server.http("POST", "/v1/completions", {"prompt": "def f(x):", "max_tokens": 80})
        statuses.append(code)
        if code == 429:
            retry.append(headers.get("Retry-After") or headers.get("retry-after"))

    threads = [threading.Thread(target=one) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert statuses.count(429) > 0 and statuses.count(200) >= 20, statuses
    assert set(statuses) <= {200, 429} and all(retry)
    assert server.health() == 200


def test_bench_serve(server, tmp_path):
    """vLLM's flag names (and specdp's older ones as aliases)."""
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "serve", "--base-url", f"http://127.0.0.1:{server.port}",
                                   "--max-concurrency", "4", "--num-prompts", "8", "--request-rate", "50",
                                   "--max-tokens", "12", "--api-key", KEY, "--save-result", "--result-filename", str(out)])
    assert res.exit_code == 0, res.output
    for label in ("request throughput", "TTFT", "TPOT", "ITL", "acceptance rate", "mean acceptance length"):
        assert label in res.output
    data = json.load(open(out))
    assert data["completed"] == 8 and data["failed"] == 0 and data["ttft_ms"]["median"] > 0
    assert data["acceptance_rate"] is not None and data["request_rate"] == 50 and data["max_concurrency"] == 4
    assert data["server_ttft_ms"] > 0 and data["server_prefill_ms"] > 0      # the server's side of TTFT
    old = tmp_path / "old.json"          # and two load-generating processes, their requests and times merged
    res = CliRunner().invoke(app, ["bench", "serve", "--url", f"http://127.0.0.1:{server.port}", "--concurrency", "2",
                                   "--num-requests", "3", "--max-tokens", "4", "--api-key", KEY, "--json", str(old),
                                   "--num-workers", "2", "--event-loop", "uvloop"])
    data = json.load(open(old))
    assert res.exit_code == 0 and data["completed"] == 3 and data["num_workers"] == 2 and data["duration_s"] > 0
    assert data["event_loop"] == "uvloop" and json.load(open(out))["event_loop"] == "asyncio"     # the default
    res = CliRunner().invoke(app, ["bench", "serve", "--url", f"http://127.0.0.1:{server.port}", "--event-loop", "trio"])
    assert res.exit_code == 2 and "--event-loop must be auto, asyncio or uvloop, not 'trio'" in res.output
    res = CliRunner().invoke(app, ["bench", "serve", "--url", f"http://127.0.0.1:{server.port}", "--concurrency", "2",
                                   "--num-workers", "3", "--api-key", KEY])
    assert res.exit_code == 1 and "--num-workers 3 is more than --max-concurrency 2" in res.output


def test_sigterm_drains_and_exits_0(server, client):
    got = {}

    def slow():
        got["r"] = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=60, temperature=0)

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert "r" in got and got["r"].choices[0].finish_reason in ("stop", "length")      # drained, not cut
    assert server.proc.wait(60) == 0


def _listeners(pid: int, port: int) -> set[int]:
    """The processes of `pid`'s tree listening on `port`."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    out = set()
    for p in procs:
        conns = getattr(p, "net_connections", None) or p.connections
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns(kind="tcp")):
                out.add(p.pid)
    return out


def test_api_server_processes(tmp_path, models):
    """server.api_server_count 2: a second process listens on the port beside the first; greedy completions over
    many connections at once equal `specdp generate`'s (dp 2 in lockstep: every rank counts the messages of both
    processes), /metrics adds up both processes' counts whichever answers, and a lost API server process stops the
    server (exit 1, saying which). On asyncio's event loop (server.event_loop), which serves where uvloop is not
    installed: the other servers here run on uvloop (auto)."""
    from concurrent.futures import ThreadPoolExecutor

    with serving(tmp_path, models, server={"api_server_count": 2, "event_loop": "asyncio"}) as (complete, expected,
                                                                                              server):
        assert len(_listeners(server.proc.pid, server.port)) == 2
        with ThreadPoolExecutor(8) as pool:       # each thread its own client: its own connection
            texts = list(pool.map(lambda _: complete(), range(8)))
        assert texts == [expected] * 8
        for _ in range(4):                        # each scrape a new connection: either process may answer
            assert server.metric("specdp:request_success_total") == 32
            assert server.metric("specdp:request_generation_tokens_count") == 32
            assert server.metric("specdp:api_server_gc_collections_total") > 0     # both processes count theirs
        api = [p for p in psutil.Process(server.proc.pid).children()
               if any("spawn_main" in part for part in p.cmdline())]
        assert len(api) == 1
        api[0].kill()
        assert server.proc.wait(60) == 1
        server.stop()
        assert "API server process 1 exited" in server.out + server.err


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_shared_http_socket_streams_without_nagle(loop):
    """The port the API server processes share: its connections get TCP_NODELAY from the event loop (asyncio's or
    uvloop's, server.event_loop) as uvicorn's own do (a socket not made as TCP by name got none from asyncio: a
    stream's chunks waited for delayed ACKs, 40 ms each)."""
    import asyncio

    from specdp_cli.server import event_loop
    from specdp_cli.server.run import http_socket

    assert event_loop.resolve(loop) == loop            # uvloop: installed with the test extras

    sock = http_socket("127.0.0.1", 0)
    other = http_socket("127.0.0.1", sock.getsockname()[1])      # a second listener on the same port
    got = []

    async def main():
        accepted = asyncio.Event()

        def on_connection(reader, writer):
            got.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            accepted.set()

        servers = [await asyncio.start_server(on_connection, sock=s) for s in (sock, other)]
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        await asyncio.wait_for(accepted.wait(), 10)
        writer.close()
        for s in servers:
            s.close()

    event_loop.run(main(), loop)
    assert got == [1]
