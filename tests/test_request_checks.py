"""Hostile numbers and bodies, checked where they enter: the one request check shared by `generate`
and the server, body parsing, prompts, the sampling tensors, the launcher's account of a silent
rank. (The same inputs against a live dp = 2 server are in test_serve_robust.py.)"""
import json
import math
import os
import signal
import subprocess

import pytest
import torch
from typer.testing import CliRunner

from dp_util import write_jsonl
from helpers import write_config
from specdp_cli.cli import app
from specdp_cli.launch import Ranks, RunDir
from specdp_cli.prompts import PromptEncoder, PromptError
from specdp_cli.request_params import ParamError, check_sampling
from specdp_cli.runtime.sampling import SamplingParams, row_tensors, uniforms
from specdp_cli.runtime.status import RECORD, StatusBoard, read_states
from specdp_cli.server.protocol import APIError, parse_json

DEFAULTS = {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0}


@pytest.mark.parametrize("raw,param", [
    ({"seed": 2 ** 64}, "seed"), ({"seed": -(2 ** 63) - 1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": 10 ** 400}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": math.nan}, "top_p"), ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 2 ** 70}, "top_k"), ({"top_k": True}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2 ** 64}, "max_tokens"), ({"max_tokens": "5"}, "max_tokens"),
    ({"stop": [1]}, "stop"), ({"stop": {"a": 1}}, "stop"),
])
def test_bad_values_name_their_field(raw, param):
    with pytest.raises(ParamError) as e:
        check_sampling(raw, DEFAULTS)
    assert e.value.param == param and param in str(e.value)


def test_good_values_and_defaults():
    p = check_sampling({"seed": 2 ** 63 - 1, "top_k": -1, "stop": ["", "\n"], "temperature": 2.5, "max_tokens": None},
                       DEFAULTS)
    assert p == {"max_tokens": 16, "temperature": 2.5, "top_p": 1.0, "top_k": 0, "seed": 2 ** 63 - 1, "stop": ["\n"]}
    assert check_sampling({"max_completion_tokens": 3}, DEFAULTS)["max_tokens"] == 3


def test_a_ranks_params_take_the_checked_values_and_leave_the_rest_at_their_defaults():
    p = SamplingParams.from_dict(check_sampling({"temperature": 0.5, "stop": ["\n"], "logprobs": 2, "seed": None,
                                                 "logit_bias": {"7": 1.5}}, DEFAULTS))
    assert (p.temperature, p.stop, p.logprobs, p.logit_bias, p.max_tokens) == (0.5, ["\n"], 2, {7: 1.5}, 16)
    assert p.seed == SamplingParams().seed and p.min_p == 0.0 and p.structured_outputs is None
    # a value of None keeps the default, and a name that is no field is not passed on
    assert SamplingParams.from_dict({"max_tokens": 3, "top_p": None, "n": 2}) == SamplingParams(max_tokens=3)


def test_extreme_seeds_sample_exactly():
    """Seeds anywhere in int64 reach the device unchanged (they were once packed through float64)."""
    seeds = [2 ** 63 - 1, -(2 ** 63), 2 ** 53 + 1, 7]
    rt = row_tensors([SamplingParams(temperature=0.8, seed=s) for s in seeds], torch.device("cpu"), pad_to=6)
    assert rt["seed"].tolist() == seeds + [0, 0]
    pos = torch.arange(6).view(6, 1)
    assert torch.equal(uniforms(rt["seed"], pos, 1), uniforms(torch.tensor(seeds + [0, 0]), pos, 1))
    u = uniforms(torch.tensor([2 ** 53, 2 ** 53 + 1]), torch.zeros(2, 1, dtype=torch.long), 1)
    assert u[0] != u[1]                       # neighbouring seeds are different streams


def test_bodies_that_used_to_give_plain_500s():
    with pytest.raises(APIError) as e:
        parse_json(b"[" * 100_000)
    assert e.value.status == 400 and "nested" in e.value.message
    with pytest.raises(APIError) as e:
        parse_json(b'{"prompt": 1')
    assert e.value.status == 400
    assert APIError(405, "x").body()["error"]["type"] == "invalid_request_error"
    assert APIError(500, "x").body()["error"]["type"] == "server_error"


def test_lone_surrogates_are_prompt_errors(models):
    from specdp_cli.modeldir import load_tokenizer

    enc = PromptEncoder(load_tokenizer(str(models["tokenizer"])), "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for bad in (lambda: enc.encode_text(json.loads('"abc\\ud800"')),
                lambda: enc.encode_chat([{"role": "user", "content": json.loads('"x\\udfff y"')}])):
        with pytest.raises(PromptError, match="lone surrogate"):
            bad()
    assert enc.encode_text("abc")


def test_token_id_prompts_take_only_ints_in_the_vocabulary(models):
    from specdp_cli.modeldir import load_tokenizer

    enc = PromptEncoder(load_tokenizer(str(models["tokenizer"])))
    n = len(enc.tokenizer)
    assert enc.encode_text([0, 5, n - 1]) == [0, 5, n - 1]
    for bad in ([], [True], [3, False], [1.0], [2, 2.5], [-1], [n], [1, "2"], [None], [[1]]):
        with pytest.raises(PromptError, match="list of integers"):
            enc.encode_text(json.loads(json.dumps(bad)))


def test_generate_turns_hostile_lines_into_error_lines(models, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", {
        "model": str(models["target"]), "max_model_len": 96, "device": "cpu",
        "speculative": {"model": str(models["draft"]), "num_speculative_tokens": 3}})
    lines = [{"id": "ok1", "prompt": "def add(a, b):", "max_tokens": 6},
             {"id": "seed", "prompt": "x", "temperature": 0.7, "seed": 2 ** 64},
             {"id": "ok2", "prompt": "for i in", "max_tokens": 6, "temperature": 0.7, "seed": 2 ** 63 - 1}]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    with open(inp, "a") as fh:                   # what json.dumps will not write: NaN, a lone surrogate
        fh.write('{"id": "nan", "prompt": "x", "temperature": NaN}\n')
        fh.write('{"id": "top_p", "prompt": "x", "top_p": NaN}\n')
        fh.write('{"id": "surrogate", "prompt": "abc\\ud800"}\n')
        fh.write("[" * 100_000 + "\n")                                   # line 7
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(app, ["generate", str(cfg), "--input", str(inp), "--output", str(out)])
    assert res.exit_code == 0, res.output
    by = {r["id"]: r for r in map(json.loads, open(out))}
    assert set(by) == {"ok1", "seed", "ok2", "nan", "top_p", "surrogate", 7}
    assert "nested too deeply" in by[7]["error"]
    assert "error" not in by["ok1"] and "error" not in by["ok2"] and by["ok2"]["completion_tokens"] == 6
    for rid, word in (("seed", "seed"), ("nan", "temperature"), ("top_p", "top_p"), ("surrogate", "surrogate")):
        assert word in by[rid]["error"], by[rid]


def test_a_stopped_rank_is_reported_unresponsive(tmp_path):
    """A rank frozen by SIGSTOP leaves no exit record but is alive: it is 'unresponsive', not 'killed'."""
    from specdp_cli.config import validate

    frozen = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        run_dir = RunDir(str(tmp_path))
        with open(run_dir.file("rank1.status"), "wb") as fh:        # rank 1's record names the frozen process
            fh.write(f"{frozen.pid}\t7\ttarget forward".encode().ljust(191) + b"\n")
        StatusBoard(run_dir.path, 0).exit("peer-lost", "rank 1 stopped responding", 1)
        cfg = validate({"model": "x", "parallel": {"data_parallel_size": 2}})
        ranks = Ranks(cfg, run_dir)
        msg = ranks.failure_message()
        assert "rank 1 is unresponsive at step 7, target forward" in msg and "stopped" in msg, msg
        assert "killed" not in msg
    finally:
        frozen.kill()
        frozen.wait()
    ranks.states_when_ended = {}
    assert "died during step 7" in ranks.failure_message()      # once the process is gone, it died


def test_a_lost_peer_report_says_where_the_rank_it_waited_for_was(tmp_path):
    """Rank 1 gave up on rank 0's step sync while rank 0 was inside a drafter forward's collective; the launcher then
    ended rank 0. The report names both: why rank 1 stopped, and where rank 0 was."""
    from specdp_cli.config import validate

    run_dir = RunDir(str(tmp_path))
    stuck = StatusBoard(run_dir.path, 0)
    stuck.set(4, "drafter forward 2/3")
    stuck.exit("terminated", "stopped by signal 15", 143)
    StatusBoard(run_dir.path, 1).exit("peer-lost", "a collective failed at step 4, step sync: no step sync from rank 0",
                                       1)
    msg = Ranks(validate({"model": "x", "parallel": {"data_parallel_size": 2}}), run_dir).failure_message()
    assert "rank 1 stopped: a collective failed at step 4" in msg, msg
    assert "rank 0 was stopped at step 4, drafter forward 2/3" in msg, msg


def test_a_ranks_status_record_is_rewritten_in_place(tmp_path):
    """The record a rank rewrites at each phase (through a shared mapping of its file) is what a reader of the file
    sees, a shorter phase leaving nothing of a longer one before it."""
    board = StatusBoard(str(tmp_path), 3)
    board.set(12, "waiting for the next step package")
    board.set(13, "target forward")
    [state] = read_states(str(tmp_path), range(3, 4))
    assert (state.pid, state.step, state.phase) == (os.getpid(), 13, "target forward")
    assert os.path.getsize(tmp_path / "rank3.status") == RECORD


def test_prompts_are_tokenized_as_the_tokenizer_tokenizes_them(models):
    """Prompts go straight to the Rust tokenizer where the transformers call would pass them to it unchanged
    (prompts._direct_backend): the same ids as the call, with a BOS added by its post-processor, special tokens
    written in the text and chat templates; a tokenizer that truncates, or whose class changes the call, keeps the
    call."""
    import copy

    from tokenizers.processors import TemplateProcessing

    from specdp_cli.modeldir import load_tokenizer

    tok = load_tokenizer(str(models["tokenizer"]))
    tok._tokenizer.post_processor = TemplateProcessing(          # a BOS on every encoding with special tokens
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.convert_tokens_to_ids("<|endoftext|>"))])
    enc = PromptEncoder(tok, "{% for m in messages %}<|pad|>{{ m['content'] }}{% endfor %}")
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: F401 - transformers 5
        assert enc.backend is not None
    except ImportError:
        assert enc.backend is None
    texts = ["def add(a, b):\n    return a + b", "  x", "<|endoftext|>in the text", "héllo 世界 🙂\t\n", "",
             "for i in range(10): " * 300]
    for text in texts:
        assert enc.encode_text(text) == list(tok(text)["input_ids"])
        messages = [{"role": "user", "content": text}]
        chat = tok.apply_chat_template(messages, chat_template=enc.template, tokenize=False, add_generation_prompt=True)
        assert enc.encode_chat(messages) == list(tok(chat, add_special_tokens=False)["input_ids"])
    assert enc.encode_text("abc")[0] == tok.convert_tokens_to_ids("<|endoftext|>")

    truncating = copy.deepcopy(tok)
    truncating._tokenizer.enable_truncation(4)
    assert PromptEncoder(truncating).backend is None

    class Lowercasing(type(tok)):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text.lower() if isinstance(text, str) else text, *args, **kwargs)

    lower = Lowercasing.from_pretrained(str(models["tokenizer"]))
    assert PromptEncoder(lower).backend is None and PromptEncoder(lower).encode_text("ABC") == list(lower("abc")["input_ids"])
