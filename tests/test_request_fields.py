"""Every field of a request is honoured or refused, never accepted and ignored (issue 31): the same rules for a
`generate` input line and an API body (`request_params.check_fields`). Honoured here: `stop_token_ids` (the
sequence ends at such a token, kept in its token ids, as vLLM keeps it), `ignore_eos`, `max_completion_tokens`;
the fields specdp does not act on yet only at their neutral value; unknown fields refused by name. The fields that
change the distribution (penalties, logit_bias, min_tokens, min_p, structured output) and logprobs:
test_sampling_fields.py."""
import json

import pytest

from dp_util import run_in_process, write_jsonl
from engine_util import eos_variant, prompts_of_lengths


@pytest.fixture(scope="module")
def eos_target(tmp_path_factory, models):
    """The tiny target with a token it often emits made eos: some greedy outputs stop early."""
    prompts = prompts_of_lengths([5, 9, 13, 17], seed=31)
    return eos_variant(models["target"], prompts, tmp_path_factory.mktemp("eos") / "target"), prompts


def greedy_past_eos(model_dir, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, n of them, eos not ending anything (a plain argmax loop, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _run(tmp_path, models, target, rows, method="draft_model"):
    from dp_util import dp_config
    cfg = dp_config(tmp_path, target, models["draft"], dp=1, method=method, k=3, M=64)
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    run_in_process(cfg, inp, out)
    return {r["id"]: r for r in map(json.loads, open(out))}


def test_stop_token_ids_ignore_eos_and_max_completion_tokens(tmp_path, models, eos_target):
    target, prompts = eos_target
    eos = json.loads((target / "config.json").read_text())["eos_token_id"]
    free = [greedy_past_eos(target, p, 24) for p in prompts]                  # greedy, eos not stopping
    stopped = next(i for i, o in enumerate(free) if eos in o)                 # a prompt whose output meets eos
    rows = [{"id": "base", "prompt": prompts[0], "max_tokens": 24},
            {"id": "stop_ids", "prompt": prompts[0], "max_tokens": 24, "stop_token_ids": [free[0][5]]},
            {"id": "eos", "prompt": prompts[stopped], "max_tokens": 24},
            {"id": "ignore_eos", "prompt": prompts[stopped], "max_tokens": 24, "ignore_eos": True},
            {"id": "mct", "prompt": prompts[1], "max_completion_tokens": 7}]
    by = _run(tmp_path, models, target, rows)
    cut = free[0].index(free[0][5])                                          # its first occurrence
    assert by["stop_ids"]["token_ids"] == free[0][:cut + 1] and by["stop_ids"]["finish_reason"] == "stop"
    assert by["eos"]["token_ids"] == free[stopped][:free[stopped].index(eos)] and by["eos"]["finish_reason"] == "stop"
    assert by["ignore_eos"]["token_ids"] == free[stopped] and by["ignore_eos"]["finish_reason"] == "length"
    assert by["mct"]["completion_tokens"] == 7


def test_unhonoured_fields_are_refused_by_name_and_neutral_ones_accepted(tmp_path, models):
    rows = [{"id": "neutral", "prompt": "def f(x):", "max_tokens": 4, "n": 1, "presence_penalty": 0, "logprobs": None,
             "echo": False, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1},
            {"id": "suffix", "prompt": "def f(x):", "suffix": "y"},
            {"id": "bias", "prompt": "def f(x):", "logit_bias": {"5000": -100}},         # past the vocabulary
            {"id": "n", "prompt": "def f(x):", "n": 3},
            {"id": "typo", "prompt": "def f(x):", "temprature": 0.5},
            {"id": "tools", "prompt": "def f(x):", "tools": [{"type": "function"}]},
            {"id": "format", "prompt": "def f(x):", "response_format": {"type": "xml"}},
            {"id": "logprobs", "prompt": "def f(x):", "max_tokens": 5, "logprobs": 2},
            {"id": "choice", "prompt": "def f(x):", "structured_outputs": {"choice": ["yes", "no"]}}]
    by = _run(tmp_path, models, models["target"], rows, method="none")
    assert "error" not in by["neutral"] and by["neutral"]["completion_tokens"] > 0
    lp = by["logprobs"]["logprobs"]             # honoured in input lines as in the API
    assert len(lp) == by["logprobs"]["completion_tokens"] and all(len(e["top_logprobs"]) == 2 for e in lp)
    assert by["choice"]["text"] in ("yes", "no") and "logprobs" not in by["choice"]
    for rid, name in (("suffix", "suffix"), ("bias", "logit_bias"), ("n", "n"), ("typo", "temprature"),
                      ("tools", "tools"), ("format", "response_format")):
        assert name in by[rid]["error"], by[rid]
    assert "unknown field 'temprature'" in by["typo"]["error"]


def test_check_fields_by_kind():
    from specdp_cli.request_params import ParamError, check_fields

    check_fields({"prompt": "x", "user": "u", "stream": True, "stop_token_ids": [3]}, "completion")
    check_fields({"messages": [], "max_completion_tokens": 3, "tool_choice": "none", "tools": []}, "chat")
    for body, kind, param in (({"prompt": "x", "suffix": "y"}, "completion", "suffix"),
                              ({"messages": [], "echo": True}, "chat", "echo"),
                              ({"messages": [], "tools": [{"type": "function"}]}, "chat", "tools"),
                              ({"prompt": "x", "max_completion_tokens": 3}, "completion", "max_completion_tokens"),
                              ({"prompt": "x", "stream": True}, "line", "stream"),
                              ({"prompt": "x", "top_logprobs": 2}, "completion", "top_logprobs"),
                              ({"prompt": "x", "best_of": 2}, "line", "best_of")):
        with pytest.raises(ParamError) as e:
            check_fields(body, kind)
        assert e.value.param == param


def test_a_grammar_the_tokenizer_cannot_follow_fails_its_line_only(tmp_path, models, monkeypatch):
    """Where llguidance cannot build a request's grammar for this tokenizer, that request fails with a sentence
    (an error line; a 500 in the server) and the job goes on."""
    from specdp_cli.runtime.structured import GrammarCompiler

    def refuse(self, spec):
        raise ValueError("no token trie for this tokenizer")

    monkeypatch.setattr(GrammarCompiler, "grammar", refuse)
    by = _run(tmp_path, models, models["target"], [
        {"id": "choice", "prompt": "def f(x):", "structured_outputs": {"choice": ["yes", "no"]}},
        {"id": "plain", "prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True}], method="none")
    assert "structured output cannot be followed" in by["choice"]["error"] and "no token trie" in by["choice"]["error"]
    assert by["plain"]["completion_tokens"] == 4
