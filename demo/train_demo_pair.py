"""Train specdp's built-in demo pair: a small target and a smaller draft that share one tokenizer.

Both are Llama-architecture causal LMs trained on the Python standard library of the running
interpreter, so they complete Python code. The folders json/, email/, asyncio/ and xml/ are held
out; `demo/prompts.jsonl` is cut from them, and the draft/target agreement is measured on them.

The draft is trained by distillation from the target (half next-token loss, half KL to the
target), which is what makes its greedy choices agree with the target's.

Usage: python demo/train_demo_pair.py [OUT_DIR] [--target-steps 1150] [--draft-steps 1200] [--draft-only]
Runs on CPU (about 25 minutes on 2 cores with the defaults). Writes OUT_DIR/{target,draft}
(weights + tokenizer), OUT_DIR/report.json, and demo/prompts.jsonl. --draft-only keeps the
target and tokenizer already in OUT_DIR and trains a new draft against them.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import sysconfig
import time

import torch
import torch.nn.functional as F

HELD_OUT = ("/json/", "/email/", "/asyncio/", "/xml/")
HERE = os.path.dirname(os.path.abspath(__file__))


def stdlib_files() -> tuple[list[str], list[str]]:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in f and "/test" not in f and "/idlelib/" not in f)
    held = [f for f in files if any(h in f for h in HELD_OUT)]
    train = [f for f in files if f not in set(held)]
    random.Random(0).shuffle(train)
    return train, held


def read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (UnicodeDecodeError, OSError):
        return ""


def build_tokenizer(files: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(f) for f in files), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|pad|>", unk_token=None)


def encode(tok, files: list[str], limit_tokens: int) -> torch.Tensor:
    ids: list[int] = []
    for f in files:
        ids.extend(tok(read(f))["input_ids"])
        ids.append(tok.eos_token_id)
        if len(ids) >= limit_tokens:
            break
    return torch.tensor(ids, dtype=torch.long)


def make_model(tok, hidden: int, layers: int, heads: int, kv_heads: int, inter: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                      max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(cfg)


def batches(data: torch.Tensor, seq: int, batch: int, gen: torch.Generator):
    n = data.numel() - seq - 1
    while True:
        idx = torch.randint(0, n, (batch,), generator=gen)
        chunk = data[idx[:, None] + torch.arange(seq + 1)[None, :]]
        yield chunk[:, :-1], chunk[:, 1:]


def train(model, data, steps: int, lr: float, teacher=None, label: str = "model",
          seq: int = 256, batch: int = 16) -> int:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1 if teacher is None else 2)
    start, step = time.time(), 0
    model.train()
    for x, y in batches(data, seq, batch, gen):
        frac = step / steps
        if frac >= 1:
            break
        for g in opt.param_groups:  # linear warm-up, cosine decay to 10%
            g["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if teacher is not None:
            with torch.no_grad():
                t = teacher(input_ids=x).logits
            kd = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1), F.log_softmax(t, -1).flatten(0, 1),
                          log_target=True, reduction="batchmean")
            loss = 0.2 * loss + 0.8 * kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            print(f"{label} step {step} loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)
    model.eval()
    return step


@torch.no_grad()
def heldout_stats(target, draft, data: torch.Tensor, seq: int = 256, n: int = 16) -> dict:
    x, y = next(batches(data, seq, n, torch.Generator().manual_seed(3)))
    t, d = target(input_ids=x).logits, draft(input_ids=x).logits
    return {
        "target_heldout_loss": F.cross_entropy(t.flatten(0, 1), y.flatten()).item(),
        "draft_heldout_loss": F.cross_entropy(d.flatten(0, 1), y.flatten()).item(),
        "greedy_agreement": (t.argmax(-1) == d.argmax(-1)).float().mean().item(),
    }


def write_prompts(held: list[str], path: str, count: int = 16) -> None:
    rng = random.Random(1)
    out = []
    for f in held:
        text = read(f)
        if len(text) < 1500:
            continue
        cut = rng.randint(200, 600)
        out.append({"id": os.path.relpath(f, sysconfig.get_paths()["stdlib"]), "prompt": text[:cut], "max_tokens": 64})
        if len(out) == count:
            break
    with open(path, "w") as fh:
        for row in out:
            fh.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=os.path.join(HERE, "pair"))
    ap.add_argument("--target-steps", type=int, default=1150)
    ap.add_argument("--draft-steps", type=int, default=1200)
    ap.add_argument("--draft-only", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    train_files, held = stdlib_files()
    report = {}
    if a.draft_only:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.path.join(a.out, "target"))
        target = AutoModelForCausalLM.from_pretrained(os.path.join(a.out, "target"), dtype=torch.float32).eval()
        with open(os.path.join(a.out, "report.json")) as fh:
            report["target_steps"] = json.load(fh).get("target_steps")
    else:
        tok = build_tokenizer(train_files, 2048)
        target = make_model(tok, hidden=192, layers=4, heads=4, kv_heads=2, inter=512)
    data = encode(tok, train_files, 6_000_000)
    held_data = encode(tok, held, 300_000)
    print(f"tokens: train {data.numel()} held-out {held_data.numel()} ({time.time() - t0:.0f}s)", flush=True)
    draft = make_model(tok, hidden=128, layers=2, heads=2, kv_heads=2, inter=384)
    report["target_params"] = sum(p.numel() for p in target.parameters())
    report["draft_params"] = sum(p.numel() for p in draft.parameters())
    if not a.draft_only:
        report["target_steps"] = train(target, data, a.target_steps, 2e-3, label="target")
    report["draft_steps"] = train(draft, data, a.draft_steps, 3e-3, teacher=target, label="draft")
    report.update(heldout_stats(target, draft, held_data))
    report["held_out_folders"] = list(HELD_OUT)
    report["torch"] = torch.__version__
    print(json.dumps(report, indent=1), flush=True)
    for name, model in ((("draft", draft),) if a.draft_only else (("target", target), ("draft", draft))):
        # bf16 on disk keeps the repo small; specdp runs it in float32 on CPU (dtype: auto)
        model.to(torch.bfloat16).save_pretrained(os.path.join(a.out, name))
        tok.save_pretrained(os.path.join(a.out, name))
    with open(os.path.join(a.out, "report.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    write_prompts(held, os.path.join(HERE, "prompts.jsonl"))
    print(f"done in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
