"""Building an engine in-process and the Hugging Face reference it must equal."""
from __future__ import annotations

import torch

from specdp_cli.config import validate
from specdp_cli.preflight import run_preflight
from specdp_cli.runtime.dist import DPGroup
from specdp_cli.runtime.engine import Engine
from specdp_cli.runtime.sampling import SamplingParams


def make_config(target, draft=None, method="draft_model", k=3, M=64, D=None, max_num_seqs=4,
                max_batched=256, **extra):
    data = {"model": str(target), "max_model_len": M, "device": "cpu", "dtype": "float32",
            "speculative": {"method": method, "num_speculative_tokens": k},
            "scheduler": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_batched}}
    if draft is not None:
        data["speculative"]["model"] = str(draft)
    if D is not None:
        data["speculative"]["max_model_len"] = D
    for key, v in extra.items():
        data[key] = {**data.get(key, {}), **v} if isinstance(v, dict) else v
    cfg = validate(data)
    report = run_preflight(cfg)
    assert report.ok, report.errors
    return cfg, report.plan


def make_engine(cfg, plan) -> Engine:
    torch.set_num_threads(1)
    return Engine(cfg, plan, DPGroup.solo(), torch.device("cpu"))


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens=30, **params) -> dict:
    """Serve prompts to the end (`max_tokens`: one for all, or a list, one a prompt); returns {index: Sequence}."""
    seed = params.pop("seed", None)
    for i, p in enumerate(prompts):
        n = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
        engine.add_request(engine.make_request(i, p, SamplingParams(max_tokens=n, **params), seed))
    done = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                done[out.seq.req.id] = out.seq
    return done


_ref_cache: dict = {}


def single_row_runner(model, N: int, bs: int = 4):
    """A CPU ModelRunner over one row of N tokens of `model` (an EAGLE head, an MTP layer) keeping the
    window's hidden states, with a KV cache of 16 blocks of `bs` tokens and a row on blocks 1..6."""
    from specdp_cli.runtime.kv_cache import allocate_kv
    from specdp_cli.runtime.model_runner import ModelRunner

    allocate_kv(model, 16, bs)
    table = torch.zeros((1, 8), dtype=torch.int32)
    table[0, :6] = torch.arange(1, 7)
    return ModelRunner(model, torch.device("cpu"), table, bs, 1, [N], window=N, keep_hidden="window")


def check_against_reference(target, done, prompts, max_tokens, M, label="") -> None:
    """Each prompt's greedy tokens (done: run_engine's result) equal transformers' for `target`."""
    for i, p in enumerate(prompts):
        ref = hf_reference(target, p, min(max_tokens, M - len(p)))
        assert done[i].generated == ref, f"{label} prompt {i} (length {len(p)}): {done[i].generated} != {ref}"


def eos_variant(target, prompts, dest):
    """A copy of `target` at `dest` whose eos is a token it often emits after these prompts (greedy, 16
    tokens) but not after every one of them: some sequences then stop early."""
    import shutil

    from helpers import set_eos

    counts: dict[int, int] = {}
    for o in (hf_reference(target, p, 16, eos=None) for p in prompts):
        for t in set(o[2:]):
            counts[t] = counts.get(t, 0) + 1
    eos = max((t for t, c in counts.items() if c < len(prompts)), key=counts.get)
    out = shutil.copytree(target, dest)
    set_eos(out, eos)
    return out


def reference_model(model_dir):
    """transformers' float32 model of `model_dir`, loaded once."""
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _ref_cache:
        _ref_cache[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _ref_cache[key]


def hf_reference(model_dir, prompt: list[int], max_new: int, eos: int | None = 0) -> list[int]:
    """transformers' greedy `generate` at batch 1, float32; the eos token (if any) stripped."""
    model = reference_model(model_dir)
    if max_new <= 0:
        return []
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, pad_token_id=1)[0, len(prompt):].tolist()
    if eos is not None and eos in out:
        out = out[:out.index(eos)]
    return out


def greedy_up_to_ties(model_dir, prompt: list[int], tokens: list[int], max_new: int, eos: int | None = 0,
                      tol: float = 1e-4) -> str | None:
    """None when `tokens` is a greedy continuation of `prompt` by transformers' float32 target up to ties: each token's
    logit (one forward over prompt + tokens) within `tol` (relative) of the best, and the tokens run to max_new or
    stop where eos is such a choice; else what is wrong. Two implementations' float32 logits differ in the last bits,
    so where two tokens' logits come within that (a randomized search meets such a prompt now and then: 5 ulps apart
    in `generate`, equal in a full forward), each picks its own: `hf_reference`'s exact tokens hold elsewhere."""
    model = reference_model(model_dir)
    if len(tokens) > max_new or (len(tokens) < max_new and eos is None):
        return f"{len(tokens)} tokens, not {max_new}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:].float()
    for i, row in enumerate(logits):
        best = row.max().item()
        want = tokens[i] if i < len(tokens) else eos if len(tokens) < max_new else None
        if want is None:
            break
        if row[want].item() < best - tol * max(1.0, abs(best)):
            return (f"token {i} ({want}): logit {row[want].item():.6f}, the best {best:.6f} "
                    f"({row.argmax().item()})")
    return None


def prompts_of_lengths(lengths, vocab=300, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def load_cpu(target, **kw):
    """specdp's decoder for a model directory, float32 on the CPU, rotary tables for 64 positions."""
    from specdp_cli.runtime.models.loader import load_model

    return load_model(str(target), torch.float32, torch.device("cpu"), 64, **kw)


def prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every position of one prefill of `ids` (up to 48 tokens) over three cache blocks of 16."""
    from specdp_cli.runtime.kv_cache import allocate_kv
    from specdp_cli.runtime.ops import AttnMeta

    allocate_kv(model, num_blocks=4, block_size=16)
    n = len(ids)
    meta = AttnMeta(positions=torch.arange(n), slot_mapping=torch.arange(n) + 16,
                    block_table=torch.tensor([[1, 2, 3, 0]], dtype=torch.int32), T=n)
    with torch.no_grad():
        return model.logits(model.forward(ids, meta))


def transformers_logits(target, ids: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits of every position of `ids` for the model directory `target`."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(ids.view(1, -1)).logits[0]
