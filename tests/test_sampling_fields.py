"""What a request asks of the distribution, with speculation on (issue 31): logit_bias, min_tokens, min_p,
presence / frequency / repetition penalties, structured output (llguidance), and the target's log-probabilities.

Lossless: a verified position j sees the row's tokens and its drafts 0..j-1, so greedy speculative tokens equal
greedy tokens without drafts under every field (on the shipped demo pair, whose drafts are often accepted — the
positions after accepted drafts are exercised), the adjusted logits equal a plain per-position reference, and
repetition penalty and bias equal transformers' processors."""
import json
import re
from pathlib import Path

import pytest
import torch

from engine_util import make_config, make_engine, run_engine
from specdp_cli.request_params import check_sampling
from specdp_cli.runtime import logits_process
from specdp_cli.runtime.sampling import SamplingParams, probabilities, row_tensors
from specdp_cli.runtime.scheduler import Request, Sequence
from specdp_cli.runtime.step_inputs import RowSpec

DEMO = Path(__file__).resolve().parent.parent / "demo" / "pair"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def demo():
    cfg, plan = make_config(DEMO / "target", DEMO / "draft", k=4, M=256)
    engine = make_engine(cfg, plan)
    tok = engine.output.tokenizer
    prompts = [tok.encode(p) for p in ("def add(a, b):\n", "import os\nimport sys\n", "class Point:\n    def ")]
    return engine, prompts


def structured(spec: dict) -> dict:
    return check_sampling({"structured_outputs": spec}, {})["structured_outputs"]


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "name": {"type": "string", "maxLength": 12}},
          "required": ["ok", "color", "name"], "additionalProperties": False}


def asks(engine, prompts):
    """The fields, each alone, with values that change the greedy output of the demo pair."""
    base = run_engine(engine, prompts, max_tokens=24)
    first = base[0].generated[0]
    return base, {
        "logit_bias": dict(logit_bias={first: -100.0, base[1].generated[3]: 4.0}),
        "repetition": dict(repetition_penalty=1.4),
        "presence_frequency": dict(presence_penalty=1.2, frequency_penalty=0.7),
        "min_tokens": dict(min_tokens=16, stop_token_ids=[base[2].generated[1]]),
        "json": dict(structured_outputs=structured({"json": SCHEMA}), max_tokens=60),
        "regex": dict(structured_outputs=structured({"regex": r"(def|class) [a-z_]{1,10}\([a-z]{0,6}\):"})),
        "choice": dict(structured_outputs=structured({"choice": ["alpha", "beta gamma", "delta"]})),
    }


def test_greedy_speculation_equals_plain_decoding_under_every_field(demo):
    engine, prompts = demo
    base, cases = asks(engine, prompts)
    for name, kw in cases.items():
        kw = {"max_tokens": 24, **kw}
        spec = run_engine(engine, prompts, **kw)
        plain = run_engine(engine, prompts, speculative=False, **kw)
        for i in range(len(prompts)):
            assert spec[i].generated == plain[i].generated, (name, i)
        assert any(spec[i].generated != base[i].generated for i in spec), f"{name} changed nothing"
        accepted = sum(s.stats.num_accepted_tokens for s in spec.values())
        assert accepted >= 4, (name, accepted)      # drafts were accepted: positions j > 0 were verified
        if "structured_outputs" in kw:              # the draft model drafts under the grammar: what it drafts fits
            drafted = sum(s.stats.num_draft_tokens for s in spec.values())
            assert accepted / drafted > 0.3, (name, accepted, drafted)


def test_what_each_field_does(demo):
    engine, prompts = demo
    base, cases = asks(engine, prompts)
    run = {name: run_engine(engine, prompts, **{"max_tokens": 24, **kw}) for name, kw in cases.items()}
    assert run["logit_bias"][0].generated[0] != base[0].generated[0]              # -100 on the greedy first token
    stop = cases["min_tokens"]["stop_token_ids"][0]
    mt = run["min_tokens"][2].generated
    assert stop not in mt[:16] and len(mt) >= 16 and (stop not in mt or mt[-1] == stop)
    for s in run["json"].values():
        obj = json.loads(engine.output.text(s))
        assert set(obj) == {"ok", "color", "name"} and isinstance(obj["ok"], bool) and obj["color"] in (
            "red", "green", "blue") and len(obj["name"]) <= 12
        assert s.finish_reason == "stop"
    for s in run["regex"].values():
        assert re.fullmatch(r"(def|class) [a-z_]{1,10}\([a-z]{0,6}\):", engine.output.text(s)), engine.output.text(s)
    assert all(engine.output.text(s) in ("alpha", "beta gamma", "delta") for s in run["choice"].values())
    rep = run["repetition"]
    assert all(len(set(rep[i].generated)) >= len(set(base[i].generated)) for i in base)


def test_sampled_rows_follow_the_grammar_and_min_p(demo):
    engine, prompts = demo
    out = run_engine(engine, prompts * 3, max_tokens=40, temperature=1.0, seed=5, min_p=0.05,
                     structured_outputs=structured({"json": SCHEMA}))
    for s in out.values():
        obj = json.loads(engine.output.text(s))
        assert obj["color"] in ("red", "green", "blue")
    rows = row_tensors([SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=1.0)], "cpu")
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2)).unsqueeze(1)
    p = probabilities(logits, rows)[:, 0]
    assert torch.allclose(p[0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)          # 0.05 < 0.2 x 0.5 dropped
    assert torch.allclose(p[1], torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_logprobs_equal_transformers(demo):
    from transformers import AutoModelForCausalLM

    engine, prompts = demo
    out = run_engine(engine, prompts, max_tokens=20, logprobs=3)
    model = AutoModelForCausalLM.from_pretrained(str(DEMO / "target"), dtype=torch.float32).eval()
    accepted = 0
    for i, p in enumerate(prompts):
        s = out[i]
        accepted += s.stats.num_accepted_tokens
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([p + s.generated])).logits[0].float(), -1)
        assert len(s.logprobs) == len(s.generated)
        for j, (t, (lp, top)) in enumerate(zip(s.generated, s.logprobs)):
            row = ref[len(p) - 1 + j]
            assert abs(lp - row[t].item()) < 1e-3
            assert [a for a, _ in top] == row.topk(3).indices.tolist() and top[0][0] == t        # greedy: the top
            assert all(abs(v - row[a].item()) < 1e-3 for a, v in top)
    assert accepted > 0                 # log-probabilities of tokens accepted from drafts are among them


def test_repetition_penalty_and_bias_equal_transformers(demo):
    """transformers' RepetitionPenaltyLogitsProcessor and a bias added to the logits, over a plain greedy loop."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    engine, prompts = demo
    model = AutoModelForCausalLM.from_pretrained(str(DEMO / "target"), dtype=torch.float32).eval()
    bias = {7: 3.0, 11: -2.5}
    ours = run_engine(engine, prompts, max_tokens=16, repetition_penalty=1.3, logit_bias=bias)
    rep = RepetitionPenaltyLogitsProcessor(1.3)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            for _ in range(len(ours[i].generated)):
                x = model(ids).logits[:, -1].float()
                for t, b in bias.items():
                    x[0, t] += b
                x = rep(ids, x)
                ids = torch.cat([ids, x.argmax(-1, keepdim=True)], 1)
        assert ours[i].generated == ids[0, len(p):].tolist()


def _row(i, prompt, generated, drafts, **params):
    req = Request(i, prompt, SamplingParams(max_tokens=50, **params))
    seq = Sequence(req, 64)
    seq.tokens += generated
    return RowSpec(seq, start=seq.L - 1, tokens=[seq.tokens[-1], *drafts], n_real=1 + len(drafts),
                   n_drafts=len(drafts))


def test_adjusted_logits_equal_a_per_position_reference():
    """Every field at once, rows with drafts: position j of a row equals the field's rule applied to the row's
    tokens followed by drafts 0..j-1."""
    g = torch.Generator().manual_seed(0)
    V, W, eos = 40, 4, 0
    rows = [_row(0, [3, 4, 5], [6, 7, 6], [7, 9, 6], presence_penalty=0.5, frequency_penalty=0.3,
                 repetition_penalty=1.7, logit_bias={9: 2.0, 1: -1.5}),
            _row(1, [8, 8], [2], [0, 5], min_tokens=3, stop_token_ids=[5]),
            _row(2, [1], [1], [], repetition_penalty=0.8, min_tokens=1)]
    R = 4                                     # a padding row too
    drafts = torch.zeros((R, W - 1), dtype=torch.long)
    n = torch.tensor([len(r.tokens) - 1 for r in rows] + [0])
    for i, r in enumerate(rows):
        drafts[i, :n[i]] = torch.tensor(r.tokens[1:])
    logits = torch.randn((R, W, V), generator=g) * 3
    adj = logits_process.build(list(enumerate(rows)), R, V, {eos}, "cpu")
    got = adj.apply(logits, drafts, n)
    for i, r in enumerate(rows):
        p, seq = r.seq.req.params, r.seq
        for j in range(n[i] + 1):
            out = seq.generated + drafts[i, :j].tolist()
            x = logits[i, j].clone()
            for t, b in p.logit_bias.items():
                x[t] += b
            if len(out) < p.min_tokens:
                x[[eos, *p.stop_token_ids]] = float("-inf")
            seen = set(seq.tokens[:seq.num_prompt]) | set(out)
            for t in seen:
                x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
            for t in set(out):
                x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
            assert torch.allclose(got[i, j], x, atol=1e-5), (i, j)
    assert torch.equal(got[3], logits[3])                                   # padding untouched
