"""Tensor parallelism (parallel.tensor_parallel_size): the column/row split of the dense decoder equals the whole
model (in-process, each TP process a thread), a step's package travels whole from leader to follower, preflight
refuses what this step does not run, and real gloo processes (dp x tp) give transformers' greedy tokens; a follower
that decides on its own is named (TP rank, phase) instead of hanging."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from dp_util import HARD_TIMEOUT_S, dp_config, read_out, run_cli, write_jsonl
from engine_util import hf_reference, load_cpu, prefill_logits, prompts_of_lengths
from helpers import make_model_dir

pytestmark = pytest.mark.timeout(HARD_TIMEOUT_S * 2)


class ThreadGroup:
    """A TP group whose processes are threads of this one: `all_reduce` sums every thread's tensor in rank order
    (so every thread gets the same sum), as the real group's all-reduce does."""

    def __init__(self, world: int):
        self.world = world
        self.parts: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def member(self, rank: int):
        group = self

        class Member:
            world = group.world

            def __init__(self):
                self.rank = rank

            def all_reduce(self, x):
                group.parts[self.rank] = x.clone()
                group.barrier.wait()
                total = group.parts[0]
                for p in group.parts[1:]:
                    total = total + p
                group.barrier.wait()
                x.copy_(total)
                return x
        return Member()


def split_logits(target, ids: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Each TP process's logits of one prefill of `ids`, the model split over `tp` threads."""
    group = ThreadGroup(tp)
    out: list = [None] * tp
    errors: list = []

    def run(rank: int) -> None:
        try:
            model = load_cpu(target, tp=group.member(rank))
            out[rank] = (model, prefill_logits(model, ids))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return out


@pytest.fixture(scope="module")
def gqa_target(tmp_path_factory, models):
    """A Qwen2 target (q/k/v biases) with 4 query heads over 2 KV heads."""
    root = tmp_path_factory.mktemp("tp")
    return make_model_dir(root / "qwen2", models["tokenizer"], family="qwen2", layers=2, heads=4, kv_heads=2, seed=5)


@pytest.mark.parametrize("tp", [2, 4])
def test_split_decoder_equals_whole(models, gqa_target, tp):
    """Column-parallel q/k/v and gate/up, row-parallel o and down with the all-reduce: the same logits as the
    unsplit model — KV heads split (tp 2 of 2 KV heads) or replicated (tp 4: each process holds the KV head its
    one query head reads) — for Llama (no biases) and Qwen2 (q/k/v biases, split with their rows)."""
    ids = torch.tensor(prompts_of_lengths([21], seed=3)[0])
    for target in (models["target"], gqa_target):
        whole = prefill_logits(load_cpu(target), ids)
        for rank, (model, logits) in enumerate(split_logits(target, ids, tp)):
            assert model.H == 4 // tp and model.KV == max(1, 2 // tp)
            assert model.layers[0].qkv.shape[0] == (model.H + 2 * model.KV) * model.D
            assert model.layers[0].down.shape[1] == 128 // tp
            torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5, msg=f"{target.name} tp {tp} rank {rank}")
