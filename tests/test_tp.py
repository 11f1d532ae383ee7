"""Tensor parallelism (parallel.tensor_parallel_size): the column/row split of the dense decoder equals the whole
model (in-process, each TP process a thread), a step's package travels whole from leader to follower, preflight
refuses what this step does not run, and real gloo processes (dp x tp) give transformers' greedy tokens; a follower
that decides on its own is named (TP rank, phase) instead of hanging."""
from __future__ import annotations

import itertools
import json
import threading

import pytest
import torch

from dp_util import HARD_TIMEOUT_S, dp_config, read_out, run_cli, selected, write_jsonl
from engine_util import hf_reference, load_cpu, prefill_logits, prompts_of_lengths
from helpers import make_deepseek_dir, make_eagle3_head, make_eagle_head, make_model_dir, make_moe_dir

pytestmark = pytest.mark.timeout(HARD_TIMEOUT_S * 2)


class ThreadGroup:
    """A TP group whose processes are threads of this one: `all_reduce` sums every thread's tensor in rank order
    (so every thread gets the same sum), as the real group's all-reduce does; `all_gather` stacks every thread's rows
    in rank order."""

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

            def all_gather(self, x):
                group.parts[self.rank] = x.clone()
                group.barrier.wait()
                out = torch.cat(group.parts)
                group.barrier.wait()
                return out
        return Member()


def split_logits(target, ids: torch.Tensor, tp: int, feats: torch.Tensor | None = None) -> list[tuple]:
    """Each TP process's (model, logits) of one prefill of `ids`, the model split over `tp` threads; with `feats`
    also (its MTP layer, the layer's logits over `ids` and `feats`)."""
    def run(member) -> tuple:
        model = load_cpu(target, tp=member)
        return (model, prefill_logits(model, ids)) + (() if feats is None else mtp_logits(target, model, ids, feats))
    return on_threads(tp, run)


def on_threads(tp: int, fn) -> list:
    """fn(member) on each of `tp` threads, each a process of one ThreadGroup: their results in rank order."""
    group = ThreadGroup(tp)
    out: list = [None] * tp
    errors: list = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(group.member(rank))
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


def mtp_logits(target, model, ids: torch.Tensor, feats: torch.Tensor) -> tuple:
    """(the MTP layer of checkpoint `target` beside its loaded `model`, the layer's logits of one prefill of `ids` with
    features `feats`)."""
    from specdp_cli.runtime.models.loader import load_head

    head = load_head("mtp", str(target), model, torch.float32, torch.device("cpu"), 64)
    head.feats = feats.clone()
    return head, prefill_logits(head, ids)


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


@pytest.fixture(scope="module")
def odd_vocab_targets(tmp_path_factory, models):
    """Llamas of 331 ids (neither tp 2 nor tp 4 divides it: the last process's rows are padded), the second with its
    LM head tied to the embedding (no lm_head.weight in its file)."""
    root = tmp_path_factory.mktemp("tp_vocab")
    odd = make_model_dir(root / "odd", models["tokenizer"], vocab=331, seed=9)
    return {"odd": odd, "odd_tied": tied_copy(odd, root / "odd_tied")}


def tied_copy(src, dst):
    """`src` with tie_word_embeddings and its lm_head.weight left out (the embedding serves as the LM head)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from helpers import set_config_json

    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    del w["lm_head.weight"]
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    set_config_json(dst, tie_word_embeddings=True)
    return dst


@pytest.mark.parametrize("tp", [2, 4])
def test_split_vocabulary_equals_whole(models, odd_vocab_targets, tp):
    """Vocab-parallel embedding and LM head: each process holds only its ceil(V / tp) rows of each (those past V
    zero), a tied LM head the same tensor; a lookup of every id (the last one's too) and the logits gathered over
    the group, the padding trimmed, equal the unsplit model's — for 320 ids (tp divides them) and 331, untied and
    tied."""
    base = prompts_of_lengths([21], vocab=320, seed=3)[0]
    for target in (models["target"], *odd_vocab_targets.values()):
        whole = load_cpu(target)
        V = whole.vocab_size
        ids = torch.tensor(base + [V - 1, 0, V - 2])
        want = prefill_logits(whole, ids)
        rows = -(-V // tp)
        for rank, (model, logits) in enumerate(split_logits(target, ids, tp)):
            assert model.vocab_size == V and logits.shape == (len(ids), V)
            first = rank * rows
            mine = min(rows, V - first)
            for split, full in ((model.embed, whole.embed), (model.lm_head, whole.lm_head)):
                assert split.shape == (rows, whole.embed.shape[1])
                assert torch.equal(split[:mine], full[first:first + mine]) and not split[mine:].any()
            assert (model.lm_head is model.embed) == (whole.lm_head is whole.embed)
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5, msg=f"{target.name} tp {tp} rank {rank}")


@pytest.fixture(scope="module")
def eagle_heads(tmp_path_factory, odd_vocab_targets):
    """EAGLE heads for the 331-id target (they fit the 320-id one too): EAGLE-1 (the target's embedding and LM
    head), EAGLE-3 over a draft vocabulary of 96 ids with the target's embedding, and EAGLE-3 with its own."""
    root, odd = tmp_path_factory.mktemp("tp_eagle"), odd_vocab_targets["odd"]
    return {"eagle": make_eagle_head(root / "eagle", odd),
            "eagle3": make_eagle3_head(root / "eagle3", odd, aux_ids=[0, 1, 2], draft_vocab=96),
            "eagle3_own": make_eagle3_head(root / "eagle3_own", odd, aux_ids=[1, 0, 2], own_embedding=True, seed=9)}


def head_drafts(target_dir, head_dir, method: str, ids: torch.Tensor, k: int, tp=None) -> tuple:
    """(the head's logits [k, V], its k greedy drafts) after a prefill of ids[:-1] — the drafter's forward 1 over the
    target's rows shifted by one, then forwards 2..k chaining the head's own features — with the target whole (tp
    None) or as process `tp` of a TP group."""
    from specdp_cli.runtime.kv_cache import allocate_kv
    from specdp_cli.runtime.model_runner import ModelRunner
    from specdp_cli.runtime.models.loader import load_head

    cpu, N, bs = torch.device("cpu"), len(ids) - 1, 16
    target = load_cpu(target_dir, tp=tp)
    head = load_head(method, str(head_dir), target, torch.float32, cpu, 64)
    table = torch.tensor([[1, 2, 3, 0]], dtype=torch.int32)
    for m in (target, head):
        allocate_kv(m, num_blocks=4, block_size=bs)
    t_run = ModelRunner(target, cpu, table, bs, 1, [N], window=N, keep_hidden="all" if head.needs_target_hidden else None)
    h_run = ModelRunner(head, cpu, table, bs, 1, [1, N], window=1, keep_hidden="window")
    head.attach(t_run)
    zero, n = torch.zeros(1, dtype=torch.long), torch.full((1,), N)
    with torch.no_grad():
        t_run.set_rows(1, ids[:N].view(1, N), zero, n, zero)
        t_run.forward(1, N, graphs=False)
        head.prepare_features(N)
        h_run.set_rows(1, ids[1:].view(1, N), zero, n, n - 1)
        logits = [h_run.forward(1, N, graphs=False)[0, 0].clone()]
        for j in range(1, k):
            head.feats[:1].copy_(h_run.hidden[:1])
            h_run.set_rows(1, logits[-1].argmax().view(1, 1), n + j - 1, torch.ones(1, dtype=torch.long), zero)
            logits.append(h_run.forward(1, 1, graphs=False)[0, 0].clone())
    logits = torch.stack(logits)
    return logits, logits.argmax(-1)


@pytest.mark.parametrize("which", ["eagle", "eagle3", "eagle3_own"])
def test_eagle_heads_draft_from_a_split_target_as_from_the_whole(odd_vocab_targets, eagle_heads, which):
    """tp 2 of the 331-id target, the head replicated: what it reads of the target's embedding and LM head goes through
    the target's vocabulary split (lookup all-reduced, logits all-gathered: every process runs the same collectives),
    an EAGLE-3 head's own embedding and draft-vocabulary LM head stay whole, its aux hidden states are the target's
    whole streams: every process's logits and k drafts equal those drafted from the unsplit target."""
    target = odd_vocab_targets["odd"]
    method = "eagle" if which == "eagle" else "eagle3"
    ids = torch.tensor(prompts_of_lengths([19], vocab=320, seed=5)[0] + [330, 0, 329])
    want, want_drafts = head_drafts(target, eagle_heads[which], method, ids, 4)
    assert want.shape == (4, 331)
    for rank, (logits, drafts) in enumerate(on_threads(2, lambda m: head_drafts(target, eagle_heads[which], method,
                                                                                  ids, 4, tp=m))):
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5, msg=f"{which} rank {rank}")
        assert drafts.tolist() == want_drafts.tolist(), f"{which} rank {rank}"


def test_a_vocabulary_other_than_vocab_size_is_refused_under_tp(tmp_path, odd_vocab_targets):
    """An embedding whose rows are not config.json's vocab_size cannot be split by it: the load says so, naming both."""
    import shutil

    from helpers import set_config_json
    from specdp_cli.runtime.models.registry import UnsupportedModel

    bad = shutil.copytree(odd_vocab_targets["odd"], tmp_path / "bad")
    set_config_json(bad, vocab_size=320)
    with pytest.raises(UnsupportedModel, match=r"(embed_tokens|lm_head).weight has 331 rows but config.json's vocab_size is 320"):
        load_cpu(bad, tp=ThreadGroup(2).member(0))


@pytest.fixture(scope="module")
def moe_targets(tmp_path_factory, models):
    """Many more experts than each token uses: a Qwen3-MoE with 16 experts, top 4 (moe_intermediate_size 48, a dense
    layer of intermediate_size 128 among the sparse ones) and a Mixtral with 8, top 2 (experts of intermediate_size
    128)."""
    root = tmp_path_factory.mktemp("tp_moe")
    qwen = make_moe_dir(root / "qwen3_moe", models["tokenizer"], "qwen3_moe", layers=3, experts=16, top_k=4, seed=7,
                        moe_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True)
    return {"qwen3_moe": qwen, "qwen3_moe_fused": fused_copy(qwen, root / "qwen3_moe_fused"),
            "mixtral": make_moe_dir(root / "mixtral", models["tokenizer"], "mixtral", experts=8, top_k=2, seed=8)}


def fused_copy(src, dst):
    """`src` with each layer's experts stored fused, as transformers 5 holds them: experts.gate_up_proj
    [E, 2 * inter, hidden] (every expert's gate rows, then its up rows) and experts.down_proj [E, hidden, inter]."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    blocks = sorted({m.group(1) for m in map(re.compile(r"(.*\.experts\.)\d+\.").match, w) if m})
    for b in blocks:
        E = len({k for k in w if k.startswith(b) and k.endswith("down_proj.weight")})
        w[b + "gate_up_proj"] = torch.stack([torch.cat([w.pop(f"{b}{e}.gate_proj.weight"),
                                                        w.pop(f"{b}{e}.up_proj.weight")]) for e in range(E)])
        w[b + "down_proj"] = torch.stack([w.pop(f"{b}{e}.down_proj.weight") for e in range(E)])
    save_file(w, str(dst / "model.safetensors"))
    return dst


def test_split_moe_equals_whole(models, moe_targets):
    """tp 2: the router whole on each process, every routed expert's gate/up split by its intermediate columns and
    its down by rows, the MoE output all-reduced: the logits of the unsplit model (Qwen3-MoE, with its dense layer
    split as a dense MLP, its experts stored one by one or fused; Mixtral's w1 / w3 / w2)."""
    ids = torch.tensor(prompts_of_lengths([21], seed=3)[0])
    wholes = {}
    for family, target in moe_targets.items():
        whole = wholes[family] = prefill_logits(load_cpu(target), ids)
        inter = 128 if family == "mixtral" else 48
        for rank, (model, logits) in enumerate(split_logits(target, ids, 2)):
            moe = model.layers[0].moe
            assert moe.gate_up.shape[:2] == (len(moe.experts), inter) and moe.down.shape[2] == inter // 2
            assert moe.route.router.shape[0] == len(moe.experts) and moe.tp is not None
            torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5, msg=f"{family} rank {rank}")
        if family != "mixtral":
            assert model.layers[1].moe is None and model.layers[1].down.shape[1] == 128 // 2
    torch.testing.assert_close(wholes["qwen3_moe_fused"], wholes["qwen3_moe"])       # the same model, stored fused


@pytest.fixture(scope="module")
def deepseek_targets(tmp_path_factory, models):
    """DeepSeek-V3 with its MTP layer (make_deepseek_dir: 4 latent-attention heads, a dense first layer of
    intermediate_size 128, then 4 routed experts of moe_intermediate_size 32 in 2 groups and a shared expert): with a
    query LoRA rank and interleaved rotary pairs, and with neither."""
    root = tmp_path_factory.mktemp("tp_deepseek")
    return {"lora": make_deepseek_dir(root / "lora", models["tokenizer"], seed=3),
            "plain": make_deepseek_dir(root / "plain", models["tokenizer"], q_lora_rank=None, rope_interleave=False,
                                       seed=4)}


def test_split_deepseek_and_its_mtp_layer_equal_whole(deepseek_targets):
    """tp 2 of DeepSeek-V3: latent attention split by heads (q_b_proj or q_proj and kv_b_proj by the heads' rows,
    o_proj by their value columns; q_a_proj, kv_a_proj_with_mqa and their norms whole), the dense layer and the shared
    expert split as a dense MLP, each routed expert by its columns, the router whole: the target's logits and its MTP
    layer's (split as the target: its own shared_head.head and the target's embedding by vocabulary rows; eh_proj and
    norms whole) equal the unsplit model's."""
    ids = torch.tensor(prompts_of_lengths([21], seed=3)[0])
    feats = torch.randn(len(ids), 64, generator=torch.Generator().manual_seed(0))
    for variant, target in deepseek_targets.items():
        whole = load_cpu(target)
        want, (_, want_mtp) = prefill_logits(whole, ids), mtp_logits(target, whole, ids, feats)
        for rank, (model, logits, head, head_logits) in enumerate(split_logits(target, ids, 2, feats)):
            for m in (model, head):
                assert m.H == m.KV == 2 and m.tp is not None
                mla, moe = m.layers[-1].mla, m.layers[-1].moe
                assert mla.kv_b.shape[0] == 2 * (16 + 16) and m.layers[-1].o.shape[1] == 2 * 16
                assert mla.q.shape[0] == 2 * (16 + 8) and mla.kv_a.shape[0] == 32 + 8
                assert moe.down.shape[2] == 16 and moe.shared_down.shape[1] == 16 and moe.tp is not None
                assert moe.route.router.shape == (4, 64)
            assert model.layers[0].down.shape[1] == 128 // 2 and head.eh_proj.shape == (64, 128)
            assert head.embed is model.embed and model.embed.shape[0] == model.lm_head.shape[0] == 320 // 2
            assert head.lm_head is not model.lm_head and head.lm_head.shape == (320 // 2, 64) and head.vocab_size == 320
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5, msg=f"{variant} rank {rank}")
            torch.testing.assert_close(head_logits, want_mtp, rtol=1e-5, atol=1e-5, msg=f"{variant} MTP rank {rank}")


class ThreadPackages:
    """The package side of a TP group of two threads: the leader's header and tensors reach the follower."""

    def __init__(self):
        self.box: list = [None]
        self.barrier = threading.Barrier(2, timeout=60)
        self.packages = 0

    def member(self, rank: int):
        group = self

        class Member:
            def share_header(self, fields, width, step=0):
                return self._share(fields)

            def share_tensor(self, t, step, what=""):
                got = self._share(t if rank == 0 else None)
                if rank:
                    t.copy_(got)
                return t

            def _share(self, value):
                if rank == 0:
                    group.box[0] = value
                group.barrier.wait()
                got = group.box[0]
                group.barrier.wait()
                return got
        return Member()


@pytest.fixture(scope="module")
def fp8_targets(tmp_path_factory, models, deepseek_targets):
    """Block-FP8 checkpoints in the published layout (test_fp8.fp8_pair), each with its dequantized float32 copy: the
    Llama target in 16 x 32 blocks and DeepSeek-V3 with its MTP layer in 16 x 16 (every tp 2 split falls on a block
    boundary), and the Llama in 128 x 128 blocks (tp 2 would split its 64 rows at 32, inside a block)."""
    import shutil

    from test_fp8 import fp8_pair

    root = tmp_path_factory.mktemp("tp_fp8")
    out = {}
    for name, src, block in (("llama", models["target"], (16, 32)), ("llama_128", models["target"], (128, 128)),
                             ("deepseek", deepseek_targets["lora"], (16, 16))):
        out[name] = fp8_pair(shutil.copytree(src, root / name), block)
    return out


def test_split_fp8_checkpoints_equal_whole(fp8_targets):
    """tp 2 of block-FP8 checkpoints: each quantized weight read as its process's output rows (column-parallel) or
    input columns (row-parallel) with the matching rows / columns of its block scales, dequantized at load on the CPU:
    the logits of the unsplit dequantized checkpoint — the Llama, and DeepSeek-V3 (latent attention, the dense, shared
    and per-expert routed weights) with its MTP layer."""
    ids = torch.tensor(prompts_of_lengths([21], seed=3)[0])
    feats = torch.randn(len(ids), 64, generator=torch.Generator().manual_seed(0))
    for name in ("llama", "deepseek"):
        path, ref = fp8_targets[name]
        mtp = feats if name == "deepseek" else None
        whole = load_cpu(ref)
        want = (prefill_logits(whole, ids),) + (() if mtp is None else (mtp_logits(ref, whole, ids, feats)[1],))
        for rank, (model, *got) in enumerate(split_logits(path, ids, 2, mtp)):
            assert model.H == (4 // 2) and model.tp is not None
            for w, g in zip(want, got[::2] if mtp is not None else got):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"{name} rank {rank}")


def test_fp8_split_inside_a_block_is_refused(fp8_targets):
    """128 x 128 blocks over 64 rows: tp 2 would give each process half a block of scales; the load refuses it naming
    tensor_parallel_size, the weight, where and why (preflight says the same: test_validate_draft_tensor_parallel_size);
    4 heads of 32 rows in 32 x 32 blocks at tp 2 and 4: whole blocks; 8 heads of 16 rows at tp 8: refused."""
    from specdp_cli.runtime.models.registry import UnsupportedModel
    from specdp_cli.runtime.models.tensor_parallel import fp8_refusal

    with pytest.raises(UnsupportedModel, match=r"tensor_parallel_size 2 would split the (output rows|input columns) "
                                               r"of model\.layers\.\d+\.\S+ \(shape \[\d+, \d+\]\) at \d+, inside one "
                                               r"of its FP8 blocks of 128x128 .*every split must fall on a multiple of 128"):
        load_cpu(fp8_targets["llama_128"][0], tp=ThreadGroup(2).member(0))
    config = {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32, "hidden_size": 128,
              "intermediate_size": 256, "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}
    headers = {f"model.layers.0.{n}{s}": ("F8_E4M3" if not s else "F32", shape) for n, shape in
               (("self_attn.q_proj.weight", [128, 128]), ("self_attn.o_proj.weight", [128, 128]),
                ("mlp.down_proj.weight", [128, 256])) for s, shape in (("", shape), ("_scale_inv", [1, 1]))}
    assert fp8_refusal(headers, config, 2) is None and fp8_refusal(headers, config, 4) is None
    why = fp8_refusal(headers, {**config, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16}, 8)
    assert "tensor_parallel_size 8 would split the output rows of model.layers.0.self_attn.q_proj.weight (shape [128, " \
           "128]) at 16, inside one of its FP8 blocks of 32x32" in why, why


def test_fp8_scales_are_cut_in_blocks():
    """A block-FP8 weight's scales are cut as its weight, a block per bm rows or bn columns: column-parallel rows
    [64, 128) in 32-row blocks are scale rows [2, 4), row-parallel columns [64, 128) in 16-column blocks scale columns
    [4, 8), a fused experts tensor's gate and up rows each; without a block (an unquantized checkpoint) a tensor of
    that name is cut as a weight."""
    from specdp_cli.runtime.models.tensor_parallel import Shard

    shard = Shard(rank=1, size=2, heads=4, kv_heads=4, head_dim=32, intermediate=128, expert_intermediate=64,
                  block=(32, 16))
    assert shard.cut("model.layers.0.self_attn.q_proj.weight_scale_inv") == (0, (slice(2, 4),))
    assert shard.cut("model.layers.0.self_attn.o_proj.weight_scale_inv") == (1, (slice(4, 8),))
    assert shard.cut("model.layers.0.mlp.experts.gate_up_proj_scale_inv") == (1, (slice(1, 2), slice(3, 4)))
    assert shard.cut("model.layers.0.mlp.experts.down_proj_scale_inv") == (2, (slice(2, 4),))
    assert shard.cut("model.layers.0.input_layernorm.weight_scale_inv") is None
    assert Shard(rank=1, size=2, heads=4, kv_heads=4, head_dim=32, intermediate=64).cut(
        "model.layers.0.self_attn.q_proj.weight_scale_inv") == (0, (slice(64, 128),))


def test_quantization_fp8_quantizes_each_process_slice(tmp_path, models):
    """`quantization: fp8` at tp 2: each process quantizes its own slice of every linear layer in 128 x 128 blocks as
    it loads (dequantized again on the CPU): the logits of the unsplit model whose weights are each process's slice
    quantized and dequantized so."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specdp_cli.runtime.models.quant import dequantize, quantizable, quantize_blocks
    from specdp_cli.runtime.models.tensor_parallel import shard_of

    src = models["target"]
    config = json.loads((src / "config.json").read_text())
    ref = shutil.copytree(src, tmp_path / "ref")
    w = load_file(str(src / "model.safetensors"))
    for name, t in w.items():
        if t.dim() != 2 or not quantizable(name):
            continue
        for rank in range(2):
            dim, (part,) = shard_of(config, rank, 2).cut(name)
            piece = t.narrow(dim, part.start, part.stop - part.start)
            piece.copy_(dequantize(*quantize_blocks(piece.clone()), (128, 128), torch.float32))
    save_file(w, str(ref / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.tensor(prompts_of_lengths([21], seed=4)[0])
    want = prefill_logits(load_cpu(ref), ids)
    assert not torch.allclose(want, prefill_logits(load_cpu(src), ids))       # the quantization shows
    for rank, logits in enumerate(on_threads(2, lambda m: prefill_logits(load_cpu(src, tp=m, quantization="fp8"), ids))):
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")


def test_step_package_reaches_the_follower_whole(models):
    """A step's package (sizes, staged rows and block table, sampling values, a logits adjustment) is staged on the
    follower exactly as the leader staged it; `stop` ends the follower's loop."""
    from specdp_cli.request_params import SamplingParams
    from specdp_cli.runtime import logits_process, step_package
    from specdp_cli.runtime.step_inputs import StepInputs
    from specdp_cli.runtime.step_types import StepSizes

    cpu = torch.device("cpu")
    leader, follower = StepInputs(8, 16, 5, cpu), StepInputs(8, 16, 5, cpu)
    leader.host[:4] = torch.arange(4 * leader.host.shape[1]).view(4, -1) - 7       # negative values travel too
    leader.bt_host[:4] = torch.arange(20, dtype=torch.int32).view(4, 5)
    leader.send(4)
    params = [SamplingParams(temperature=0.7, top_k=5, seed=11), SamplingParams(), SamplingParams(temperature=1.3)]
    adjust = logits_process.LogitsAdjust(torch.randn(4, 9), None, None, None, None, None, [], 9)
    pkg = step_package.StepPackage(7, StepSizes(4, 3, 4, 16, 16, k=3), True, 2,
                                   __import__("specdp_cli.runtime.sampling", fromlist=["x"]).row_values(params, 4),
                                   adjust)
    group = ThreadPackages()
    got: list = []
    t = threading.Thread(target=lambda: got.extend([step_package.receive(group.member(1), follower, cpu, 6),
                                                    step_package.receive(group.member(1), follower, cpu, 7)]))
    t.start()
    step_package.send(group.member(0), pkg, leader)
    step_package.stop(group.member(0), 7)
    t.join()
    first, second = got
    assert second is None
    assert first.decision() == pkg.decision() and first.step == 7
    assert torch.equal(follower.dev[:4], leader.dev[:4]) and torch.equal(follower.block_table[:4], leader.block_table[:4])
    for a, b in zip(first.sampling[1], pkg.sampling[1]):
        assert torch.equal(a, b)
    assert first.sampling[0] == pkg.sampling[0]
    assert torch.equal(first.adjust.bias, adjust.bias)


def validate(cfg_path, *args):
    from typer.testing import CliRunner

    from specdp_cli.cli import app

    res = CliRunner().invoke(app, ["validate", "config", str(cfg_path), "--json", *args])
    return res.exit_code, (json.loads(res.stdout) if res.stdout.strip().startswith("{") else None)


def parallel_check(out) -> dict:
    return next(c for c in out["checks"] if c["name"] == "parallel")


def test_validate_shows_the_layout_and_refuses_what_this_step_does_not_run(tmp_path, models, eagle_heads, monkeypatch):
    from specdp_cli import plan as plan_module

    def cfg(tp, **extra):
        return dp_config(tmp_path, models["target"], models["draft"], dp=2, M=64, D=40, name=f"c{next(n)}.yaml",
                         parallel={"tensor_parallel_size": tp}, **extra)
    n = itertools.count()

    code, out = validate(cfg(2))
    assert code == 0, out["errors"]
    whole = validate(cfg(1))[1]["layout"]
    lay = out["layout"]
    assert (lay["data_parallel_size"], lay["tensor_parallel_size"], lay["processes"]) == (2, 2, 4)
    assert whole["weight_bytes_per_gpu"] > lay["weight_bytes_per_gpu"] > whole["weight_bytes_per_gpu"] / 2
    assert lay["kv_bytes_per_token_per_gpu"] < whole["kv_bytes_per_token_per_gpu"]
    assert "layout 2 x 2" in parallel_check(out)["detail"] and "split 2 per process" in parallel_check(out)["detail"]
    # tp 4 over 2 KV heads: replicated
    code, out = validate(cfg(4))
    assert code == 0 and "replicated" in parallel_check(out)["detail"]
    # EAGLE heads: replicated on every process
    for method in ("eagle", "eagle3"):
        code, out = validate(dp_config(tmp_path, models["target"], eagle_heads[method], dp=2, M=64, D=40,
                                       method=method, name=f"c{next(n)}.yaml", parallel={"tensor_parallel_size": 2}))
        assert code == 0, out["errors"]
        assert "The EAGLE head is replicated on every process" in parallel_check(out)["detail"], method
    # refused, each with a sentence naming tensor_parallel_size
    code, out = validate(cfg(3))
    assert code == 1 and any("tensor_parallel_size 3 does not divide the target's 4 attention heads" in e
                             for e in out["errors"]), out["errors"]
    monkeypatch.setattr(plan_module, "cuda_device_count", lambda: 3)
    monkeypatch.setattr(plan_module, "device_memory", lambda device: (80 << 30, 80 << 30))
    code, out = validate(cfg(2, device="cuda", dtype="bfloat16"))
    assert code == 1 and "does not divide the 3 GPUs" in parallel_check(out)["detail"]


def test_validate_draft_tensor_parallel_size(tmp_path, models, copy_draft, eagle_heads, deepseek_targets, fp8_targets):
    """speculative.draft_tensor_parallel_size: at tp 2 a draft model is replicated (unset or 1) or split (2), the layout
    says which, and the weights and KV cache per GPU count it split (the draft here is a copy of the target: split it
    holds what the target holds, its KV cache per process halves too); refused, naming the field and what to set: a
    value other than 1 or tensor_parallel_size, any value for ngram, 2 for an EAGLE head (replicated), 1 for mtp at tp 2
    (the MTP layer is split as its target); a block-FP8 target or draft model whose tp 2 split falls inside a 128 x 128
    block, naming tensor_parallel_size or the draft's field; a split FP8 checkpoint on block boundaries is accepted."""
    n = itertools.count()

    def check(target=models["target"], draft=copy_draft, tp=2, dtp=None, method="draft_model", **extra):
        spec = {} if dtp is None else {"draft_tensor_parallel_size": dtp}
        return validate(dp_config(tmp_path, target, draft if method in ("draft_model", "eagle") else None, dp=1, M=M,
                                  D=D, method=method, name=f"c{next(n)}.yaml", parallel={"tensor_parallel_size": tp},
                                  speculative=spec, **extra))

    def refused(words, **kw):
        code, out = check(**kw)
        assert code == 1 and any(words in e for e in out["errors"]), out["errors"]

    layouts = {}
    for dtp in (None, 1, 2):
        code, out = check(dtp=dtp)
        assert code == 0, out["errors"]
        layouts[dtp] = out["layout"]
        detail = parallel_check(out)["detail"]
        assert ("The draft model is split over the TP group as the target" if dtp == 2 else
                "The draft model is replicated on every process") in detail, detail
    assert layouts[None] == layouts[1] and layouts[1]["draft_tensor_parallel_size"] == 1
    assert layouts[2]["draft_tensor_parallel_size"] == 2
    target_alone = check(method="none")[1]["layout"]
    assert layouts[2]["weight_bytes_per_gpu"] == pytest.approx(2 * target_alone["weight_bytes_per_gpu"], rel=1e-6)
    assert layouts[2]["kv_bytes_per_token_per_gpu"] == 2 * target_alone["kv_bytes_per_token_per_gpu"]
    assert layouts[1]["kv_bytes_per_token_per_gpu"] == 3 * target_alone["kv_bytes_per_token_per_gpu"]
    key = "speculative.draft_tensor_parallel_size"
    refused(f"{key} 3: the allowed values are 1 (the drafter replicated on every process) or tensor_parallel_size "
            f"(2: split over the TP group as the target)", dtp=3)
    refused(f"{key} 2: the allowed values are 1 (the drafter replicated on every process).", tp=1, dtp=2)
    refused(f"{key} is set but method ngram has no drafter model", dtp=1, method="ngram")
    refused(f"{key} 2 with method eagle: the EAGLE head is replicated", draft=eagle_heads["eagle"], dtp=2,
            method="eagle")
    refused(f"{key} 1 with method mtp: the MTP layer lives in the target's checkpoint and is split over the TP group as "
            f"the target is: set {key}: 2", target=deepseek_targets["lora"], dtp=1, method="mtp")
    assert check(target=deepseek_targets["lora"], method="mtp")[0] == 0
    three_heads = make_model_dir(tmp_path / "three", models["tokenizer"], layers=1, hidden=48, heads=3, kv_heads=1)
    refused(f"{key} 2 does not divide the drafter's 3 attention heads (num_attention_heads): set {key}: 1 (the drafter "
            f"replicated on every process).", draft=three_heads, dtp=2)
    fp8_128, fp8_16 = fp8_targets["llama_128"][0], fp8_targets["llama"][0]
    refused("tensor_parallel_size 2 would split the", target=fp8_128, draft=models["draft"])
    refused(f"{key} 2 would split the", draft=fp8_128, dtp=2)
    code, out = check(target=fp8_16, draft=fp8_16, dtp=2)
    assert code == 0 and "split with their 16x32 block scales" in parallel_check(out)["detail"], out["errors"]


def held_bytes(model) -> int:
    """Bytes of the weights a loaded decoder holds (its layers' tensors — latent attention's too —, the experts, shared
    ones included, and the router, embedding, norm, LM head: once where tied)."""
    import dataclasses

    def tensors(part, skip=()) -> int:
        return sum(v.nbytes for f in dataclasses.fields(part) if f.name not in skip
                   for v in [getattr(part, f.name)] if isinstance(v, torch.Tensor))

    total = model.embed.nbytes + model.norm.nbytes + (model.lm_head.nbytes if model.lm_head is not model.embed else 0)
    for layer in model.layers:
        total += tensors(layer, skip=("rope",)) + (tensors(layer.mla) if layer.mla is not None else 0)
        if layer.moe is not None:
            total += tensors(layer.moe) + tensors(layer.moe.route)
    return total


def mtp_held_bytes(head) -> int:
    """Bytes of the weights an MTP layer holds of its own (the target's embedding is not)."""
    return held_bytes(head) - head.embed.nbytes + head.enorm.nbytes + head.hnorm.nbytes + head.eh_proj.nbytes


def test_validate_counts_the_vocabulary_split(tmp_path, odd_vocab_targets):
    """tp 2 of 331 ids, untied and tied: the weights per GPU preflight reports are what a process loads (its 166
    padded rows of the embedding and of the LM head, or of the one tied table), and the TP line says the embedding
    and LM head are split by vocabulary."""
    from types import SimpleNamespace

    n = itertools.count()
    for name, target in odd_vocab_targets.items():
        def layout(tp):
            code, out = validate(dp_config(tmp_path, target, None, dp=1, method="none", M=M, name=f"c{next(n)}.yaml",
                                           parallel={"tensor_parallel_size": tp}))
            assert code == 0, out["errors"]
            return out["layout"]["weight_bytes_per_gpu"], parallel_check(out)["detail"]
        whole, reported, detail = layout(1)[0], *layout(2)
        assert "embedding and LM head split by vocabulary (331 rows, 166 per process)" in detail
        loaded = load_cpu(target, tp=SimpleNamespace(rank=1, world=2))
        assert reported / whole == pytest.approx(held_bytes(loaded) / held_bytes(load_cpu(target)), rel=1e-5), name


def test_validate_counts_the_experts_split_and_refuses_what_does_not_divide(tmp_path, models, moe_targets):
    """A Qwen3-MoE at tp 2 (and dp 2 with the experts over the DP ranks too): the weights per GPU preflight reports
    are what a process loads; tp 4 over experts of moe_intermediate_size 18 is refused, naming tensor_parallel_size
    and the field."""
    from types import SimpleNamespace

    target = moe_targets["qwen3_moe"]
    n = itertools.count()

    def per_gpu(dp, tp, ep):
        cfg = dp_config(tmp_path, target, None, dp=dp, dp_sync="auto", method="none", M=M, name=f"c{next(n)}.yaml",
                        parallel={"tensor_parallel_size": tp, "enable_expert_parallel": ep})
        code, out = validate(cfg)
        assert code == 0, out["errors"]
        return out["layout"]["weight_bytes_per_gpu"], parallel_check(out)["detail"]

    whole = per_gpu(1, 1, False)[0]            # (the files' size: their headers too, so compared as shares)
    for dp, ep in ((1, False), (2, True)):
        reported, detail = per_gpu(dp, 2, ep)
        assert "each routed expert's 48 columns (moe_intermediate_size) split 24 per process" in detail
        loaded = load_cpu(target, tp=SimpleNamespace(rank=1, world=2), ep=SimpleNamespace(rank=1, world=2) if ep else None)
        assert reported / whole == pytest.approx(held_bytes(loaded) / held_bytes(load_cpu(target)), rel=1e-5), (dp, ep)
    odd = make_moe_dir(tmp_path / "odd", models["tokenizer"], "qwen3_moe", layers=1, moe_intermediate_size=18)
    code, out = validate(dp_config(tmp_path, odd, None, dp=1, method="none", M=M, name="c4.yaml",
                                   parallel={"tensor_parallel_size": 4}))
    assert code == 1 and any("tensor_parallel_size 4 does not divide the target's moe_intermediate_size 18" in e
                             for e in out["errors"]), out["errors"]


def test_validate_deepseek_mtp_at_tp2_counts_the_split(tmp_path, deepseek_targets):
    """DeepSeek-V3 with method mtp at tp 2 (and dp 2 with the experts over the DP ranks too): accepted; the weights
    per GPU preflight reports are what a process loads of the target and its MTP layer (latent attention, dense MLP,
    shared and routed experts split), the KV cache per GPU half (each process caches its heads); tp 3 does not divide
    the 4 heads: refused naming tensor_parallel_size."""
    from types import SimpleNamespace

    from specdp_cli.runtime.models.loader import load_head

    target = deepseek_targets["lora"]
    n = itertools.count()

    def cfg(dp, tp, ep=False):
        return dp_config(tmp_path, target, None, dp=dp, dp_sync="auto", method="mtp", M=M, D=D, name=f"c{next(n)}.yaml",
                         parallel={"tensor_parallel_size": tp, "enable_expert_parallel": ep})

    def loaded(tp, ep):
        model = load_cpu(target, tp=tp, ep=ep)
        return held_bytes(model) + mtp_held_bytes(load_head("mtp", str(target), model, torch.float32,
                                                            torch.device("cpu"), 64, ep=ep))
    code, out = validate(cfg(1, 1))
    assert code == 0, out["errors"]
    whole, whole_kv = out["layout"]["weight_bytes_per_gpu"], out["layout"]["kv_bytes_per_token_per_gpu"]
    for dp, ep in ((1, False), (2, True)):
        code, out = validate(cfg(dp, 2, ep))
        assert code == 0, out["errors"]
        detail = parallel_check(out)["detail"]
        assert "latent attention by heads" in detail and "the shared experts' 32 columns split 16 per process" in detail
        assert "The MTP layer is split as the target." in detail
        lay = out["layout"]
        assert lay["kv_bytes_per_token_per_gpu"] == whole_kv // 2          # 4 layers (MTP's too) x 2 heads x 40 x 4 bytes
        share = SimpleNamespace(rank=1, world=2)
        assert lay["weight_bytes_per_gpu"] / whole == pytest.approx(loaded(share, share if ep else None) / loaded(None, None),
                                                                   rel=1e-5), (dp, ep)
    code, out = validate(cfg(1, 3))
    assert code == 1 and any("tensor_parallel_size 3 does not divide the target's 4 attention heads" in e
                             for e in out["errors"]), out["errors"]


def test_refusal_reads_the_intermediate_sizes_the_model_splits():
    """A dense MLP's intermediate_size is checked only where some layer has one (Qwen3-MoE's mlp_only_layers or
    decoder_sparse_step); the experts' own size always (Mixtral's: intermediate_size)."""
    from specdp_cli.runtime.models.tensor_parallel import refusal

    qwen = {"model_type": "qwen3_moe", "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4,
            "intermediate_size": 6, "moe_intermediate_size": 64, "num_experts": 8}
    assert refusal(qwen, 4) is None
    for dense in ({"mlp_only_layers": [2]}, {"decoder_sparse_step": 2}):
        assert "intermediate_size 6" in refusal({**qwen, **dense}, 4)
    assert "moe_intermediate_size 66" in refusal({**qwen, "moe_intermediate_size": 66}, 4)
    deepseek = {"model_type": "deepseek_v3", "num_attention_heads": 8, "num_key_value_heads": 1, "kv_lora_rank": 16,
                "intermediate_size": 6, "moe_intermediate_size": 64, "n_routed_experts": 8, "first_k_dense_replace": 0}
    assert refusal(deepseek, 4) is None           # latent attention: every head caches its own key and value
    assert "intermediate_size 6" in refusal({**deepseek, "first_k_dense_replace": 1}, 4)
    assert "moe_intermediate_size 66" in refusal({**deepseek, "moe_intermediate_size": 66}, 4)
    mixtral = {"model_type": "mixtral", "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4,
               "intermediate_size": 66, "num_local_experts": 8}
    assert "tensor_parallel_size 4 does not divide the target's intermediate_size 66" in refusal(mixtral, 4)


def test_expert_collectives_under_tp_are_checked_in_their_group(monkeypatch):
    """check_collectives under tensor parallelism: an expert-parallel collective's descriptors are compared within
    the processes of this TP rank (its EP group, never the leaders' step group), and a mismatch names the TP rank."""
    import torch.distributed as dist

    from specdp_cli.runtime.dist import DPGroup, OutOfStepError

    g = DPGroup(rank=1, world=2, lockstep=True, check=True, proc=3, procs=4)
    g.step_group, g.ep_group = "leaders", "tp rank 1"
    g.tp = type("TP", (), {"rank": 1, "_at": None})()
    g.publish(5, "target forward")
    used = []

    def gather(out, obj, group):
        used.append(group)
        out[:] = [obj, ("all_gather", "-", (9, 64), "torch.float32", 5, "target forward")]
    monkeypatch.setattr(dist, "all_gather_object", gather)
    with pytest.raises(OutOfStepError, match=r"collective mismatch among the processes of TP rank 1 "
                                             r"\(check_collectives\): rank 0: all_gather .* shape=\(8, 64\)"):
        g.ep_all_gather(torch.zeros(8, 64))
    assert used == ["tp rank 1"]


def test_generate_refuses_a_tp_that_does_not_divide_the_heads(tmp_path, models):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "def", "max_tokens": 2}])
    cfg = dp_config(tmp_path, models["target"], models["draft"], dp=1, parallel={"tensor_parallel_size": 3})
    from typer.testing import CliRunner

    from specdp_cli.cli import app

    res = CliRunner().invoke(app, ["generate", str(cfg), "--input", str(inp), "--output", str(tmp_path / "out.jsonl")])
    assert res.exit_code == 1 and "tensor_parallel_size 3 does not divide" in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


M, D, K = 64, 40, 3          # no-draft window [38, 63]


class TPJob:
    """A `generate` over requests of the given prompt lengths and max_tokens (two of the default four cross the
    drafter's limit D) with the `dp_config` keywords given, started by `tp_jobs`."""

    def __init__(self, tmp, target, draft, seed: int, lengths=(30, 9, 13, 33), max_tokens=(30, 12, 25, 20),
                 env=None, reference=None, **config):
        self.tmp, self.reference = tmp, reference or target
        self.prompts, self.max_tokens = prompts_of_lengths(list(lengths), seed=seed), list(max_tokens)
        inp = write_jsonl(tmp / "in.jsonl", [{"id": f"r{i}", "prompt": p, "max_tokens": n}
                                             for i, (p, n) in enumerate(zip(self.prompts, self.max_tokens))])
        cfg = dp_config(tmp, target, draft, **{"dp_sync": "auto", "k": K, "M": M, "D": D, **config})
        self.args = ("generate", cfg, "--input", inp, "--output", tmp / "out.jsonl", "--summary-json", tmp / "s.json")
        self.env = env

    def equals_transformers(self, r) -> tuple[dict, str]:
        """The job ended well, every request's greedy tokens equal transformers' target-only ones (of `reference`,
        default the target) and some sequence passes D - K. Returns the summary and the job's output text."""
        assert r.returncode == 0, r.stdout + r.stderr
        out = read_out(self.tmp / "out.jsonl")
        for i, (p, n) in enumerate(zip(self.prompts, self.max_tokens)):
            ref = hf_reference(self.reference, p, min(n, M - len(p)))
            assert out[json.dumps(f"r{i}")]["token_ids"] == ref, f"r{i} (prompt {len(p)} tokens)"
        assert any(len(p) + len(out[json.dumps(f"r{i}")]["token_ids"]) > D - K for i, p in enumerate(self.prompts))
        return json.load(open(self.tmp / "s.json")), r.stdout + r.stderr


@pytest.fixture(scope="module")
def copy_draft(tmp_path_factory, models):
    """A draft model that is the target itself: every draft is accepted (the random one accepts none)."""
    return make_model_dir(tmp_path_factory.mktemp("tp_draft") / "draft", models["tokenizer"], copy_of=models["target"])


@pytest.fixture(scope="module", autouse=True)
def tp_jobs(request, tmp_path_factory, models, launches) -> dict:
    """The launched tests' jobs (4 processes for dp 2 x tp 2) and the server test's server, each selected one started
    when this module starts: they run two at a time while the in-process tests above run, each test then checks its
    own."""
    jobs = {}

    def add(key, target, draft, seed, exclusive=False, **kw):
        job = jobs[key] = TPJob(tmp_path_factory.mktemp("tp_job"), target, draft, seed, **kw)
        launches.start(key, *job.args, env=job.env, exclusive=exclusive)

    # first, and not alone: tp-skip spends most of its run idle, waiting out its 5 s collective timeout while the
    # launch beside it has the CPU
    for p in sorted(selected(request, "test_a_follower_that_decides_alone_is_named"), key=lambda p: p["check"]):
        # two requests of 20 tokens; a collective timeout of 5 s (what the test's wall-time bound is measured against:
        # caught at once, or named by the timeout, never a hang)
        add(("follower", p["fault"]), models["target"], models["draft"], 17, lengths=[13, 20],
            max_tokens=[20, 20], env={"SPECDP_FAULT": p["fault"]}, dp=1, dp_sync="always", D=None, timeout_s=5,
            check=p["check"], parallel={"tensor_parallel_size": 2})
    if selected(request, "test_serve_at_tp2_equals_generate"):
        from test_serve import free_port, server_config, start_server_ahead

        tmp, port = tmp_path_factory.mktemp("tp_serve"), free_port()
        cfg = server_config(tmp, models, port, parallel={"data_parallel_size": 1, "tensor_parallel_size": 2})
        start_server_ahead(request, launches, "server", cfg, port, SPECDP_TEST_REAL_RANKS="1")   # ranks() finds them
        jobs["server"] = (tmp, cfg, port)
    fixture = request.getfixturevalue
    for p in selected(request, "test_tp2_generate_equals_transformers"):
        dp, dp_sync, draft = p["dp"], p["dp_sync"], p["draft"]
        target, reference = fixture("fp8_targets")["llama"] if draft == "fp8" else (models["target"], models["target"])
        add(("dense", dp), target, reference if draft == "fp8" else models["draft"], 17, reference=reference,
            lengths=[30, 4, 9, 13, 20, 33], max_tokens=[30, 3, 12, 25, 40, 20], dp=dp, dp_sync=dp_sync,
            check=dp == 2, parallel={"tensor_parallel_size": 2},
            speculative={"draft_tensor_parallel_size": 2 if draft == "fp8" else 1})
    if selected(request, "test_tp2_eagle3_generate_equals_transformers"):
        add("eagle3", models["target"], fixture("eagle_heads")["eagle3"], 21, dp=1, method="eagle3", check=True,
            parallel={"tensor_parallel_size": 2})
    for p in selected(request, "test_tp2_moe_generate_equals_transformers"):
        dp = p["dp"]
        add(("moe", dp), fixture("moe_targets")["qwen3_moe"], models["draft"], 19, dp=dp, check=dp == 2,
            parallel={"tensor_parallel_size": 2, "enable_expert_parallel": dp == 2})
    for p in selected(request, "test_tp2_deepseek_mtp_generate_equals_transformers"):
        dp = p["dp"]
        add(("deepseek", dp), fixture("deepseek_targets")["lora"], None, 19, dp=dp, method="mtp", check=dp == 2,
            parallel={"tensor_parallel_size": 2, "enable_expert_parallel": dp == 2})
    return jobs


@pytest.mark.parametrize("dp,dp_sync,draft", [(1, "never", "fp8"), (2, "always", "random")])
def test_tp2_generate_equals_transformers(tp_jobs, launches, dp, dp_sync, draft):
    """dp x tp 2 processes (gloo): greedy float32 tokens equal transformers' greedy generate, with sequences that
    cross the drafter's limit (D = 40 < M = 64: lengths 38..63 draft nothing); at dp 2 in lockstep with every
    collective checked (check_collectives: the TP all-reduces and each step package too), the draft model replicated on
    every process. At dp 1 the target is a block-FP8 checkpoint (16 x 32 blocks: each process reads its whole blocks
    and their scales, dequantized at load on the CPU; the reference is transformers on the dequantized weights) and the
    draft model, the dequantized copy, is split over the TP group as the target (draft_tensor_parallel_size 2): its
    drafts are the target's own tokens, so (nearly) every one is accepted."""
    r, secs = launches.result(("dense", dp))
    summary, log = tp_jobs[("dense", dp)].equals_transformers(r)
    assert [x["rank"] for x in summary["ranks"]] == list(range(dp))          # per DP rank
    assert sum(x["requests"] for x in summary["ranks"]) == 6
    if draft == "fp8":
        assert summary["num_accepted_tokens"] >= 0.9 * summary["num_draft_tokens"] > 0, summary
    assert "TP rank 1 of 2" in log                                          # every process's ready line
    assert ("draft model split over 2 processes" in log) == (draft == "fp8")


def test_tp2_eagle3_generate_equals_transformers(tp_jobs, launches):
    """tp 2 x dp 1 with an EAGLE-3 head (draft vocabulary of 96 ids, the target's vocab-split embedding) replicated on
    both processes, every collective and the drafts checked across the group (check_collectives): greedy float32
    tokens equal transformers' target-only greedy generate, with sequences crossing the drafter's limit (D = 40 < M =
    64: lengths 38..63 draft nothing)."""
    summary, log = tp_jobs["eagle3"].equals_transformers(launches.result("eagle3")[0])
    assert summary["num_draft_tokens"] > 0
    assert "TP rank 1 of 2" in log


@pytest.mark.parametrize("dp", [1, 2])
def test_tp2_moe_generate_equals_transformers(tp_jobs, launches, dp):
    """A Qwen3-MoE (16 experts, top 4) at tp 2: every expert's columns split over the TP group, the MoE output
    all-reduced over it; at dp 2 the experts are split over the DP ranks too (expert parallelism: each of the 4
    processes holds half the columns of 8 experts), tokens gathered and reduce-scattered among the processes of one
    TP rank, in lockstep with every collective checked. Greedy float32 tokens equal transformers', with a drafter
    and sequences crossing the drafter's limit (D = 40 < M = 64)."""
    summary, _ = tp_jobs[("moe", dp)].equals_transformers(launches.result(("moe", dp))[0])
    ranks = summary["ranks"]
    whole = 16 * 3 * 48 * 64 * 4 * 2                 # float32 routed experts of the two sparse layers
    assert [x["expert_weight_bytes"] for x in ranks] == [whole // (2 * dp)] * dp     # a leader's share


@pytest.mark.parametrize("dp", [1, 2])
def test_tp2_deepseek_mtp_generate_equals_transformers(tp_jobs, launches, dp):
    """DeepSeek-V3 at tp 2 with method mtp: latent attention, dense layer, routed and shared experts and the MTP layer
    split over the TP group; every process runs the MTP layer's forwards over the rows its leader staged, the drafts
    the leader's (they reach the followers in the next step's package). At dp 2 the experts (the MTP layer's too) are
    split over the DP ranks as well, in lockstep with every collective checked. Greedy float32 tokens equal
    transformers' target-only greedy generate, with sequences crossing the drafter's limit (D = 40 < M = 64)."""
    summary, _ = tp_jobs[("deepseek", dp)].equals_transformers(launches.result(("deepseek", dp))[0])
    assert summary["num_draft_tokens"] > 0
    whole = 3 * 4 * 3 * 32 * 64 * 4                # float32 routed experts of the two sparse layers and the MTP layer
    assert [x["expert_weight_bytes"] for x in summary["ranks"]] == [whole // (2 * dp)] * dp     # a leader's share


@pytest.mark.parametrize("fault,check", [("tp-alter:1:3", True), ("tp-skip:1:3", False)])
def test_a_follower_that_decides_alone_is_named(launches, fault, check):
    """tp-alter: a follower drafts nothing where its leader drafts (vLLM #49027's disagreement), caught at once by
    check_collectives comparing the step package; tp-skip: a follower misses a step package, so the two sides
    wait in different collectives until the collective timeout names each (TP rank, phase) — never a hang."""
    r, secs = launches.result(("follower", fault))
    err = r.stdout + r.stderr
    assert r.returncode == 1, err
    if check:
        assert "collective mismatch in the TP group of DP rank 0" in err and "at step 3, step package" in err, err
        assert "TP rank 1 of DP rank 0: package R_pad=2 K=0" in err and "TP rank 0 of DP rank 0: package R_pad=2 K=3" in err
    else:
        assert "TP rank 0 of DP rank 0: a collective of its TP group failed at step 3, step package" in err, err
        assert "TP rank 1 of DP rank 0: a collective of its TP group failed at step 2, target forward" in err, err
    assert secs < 60, secs


def test_serve_at_tp2_equals_generate(tp_jobs, launches):
    """`specdp serve` at dp 1 x tp 2: the leader serves, its follower runs each step's device work with it; greedy
    completions and a seeded sampled one (the sampling values travel in the step package) equal what one process
    generates."""
    import openai
    from typer.testing import CliRunner

    from specdp_cli.cli import app
    from test_serve import KEY, PROMPTS

    tmp_path, cfg, port = tp_jobs["server"]
    rows = [{"prompt": p, "max_tokens": 16} for p in PROMPTS] + [{"prompt": PROMPTS[0], "max_tokens": 12,
                                                                  "temperature": 0.8, "seed": 5}]
    res = CliRunner().invoke(app, ["generate", str(cfg), "--input", str(write_jsonl(tmp_path / "in.jsonl", rows)),
                                   "--output", str(tmp_path / "o.jsonl"), "--set", "parallel.tensor_parallel_size=1"])
    assert res.exit_code == 0, res.output
    expected = [json.loads(x)["text"] for x in open(tmp_path / "o.jsonl")]
    server = launches.result("server")
    try:
        assert len(server.ranks()) == 2
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        got = [client.completions.create(model="tiny", prompt=r["prompt"], max_tokens=r["max_tokens"],
                                         temperature=r.get("temperature", 0), seed=r.get("seed")).choices[0].text
               for r in rows]
        assert got == expected
    finally:
        server.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8")
def test_split_fp8_kept_fp8_on_a_gpu_equals_whole(tmp_path, models):
    """FP8 kept FP8 on a GPU (bf16, W8A8) at tp 2, the two processes threads on one GPU: a 128 x 128-block checkpoint
    and `quantization: fp8` over a Llama whose every split falls on a 128 boundary (2 heads of 128, intermediate 512):
    each process's FP8 weights are its whole blocks (its slice quantized, for `quantization: fp8`: the same blocks), and
    its logits equal the unsplit FP8 model's up to bf16 rounding of the partial sums."""
    from specdp_cli.runtime.kv_cache import allocate_kv
    from specdp_cli.runtime.models.loader import load_model
    from specdp_cli.runtime.models.quant import FP8Weight
    from specdp_cli.runtime.ops import AttnMeta
    from test_fp8 import fp8_pair

    src = make_model_dir(tmp_path / "wide", models["tokenizer"], layers=2, hidden=256, heads=2, kv_heads=2, seed=6)
    checkpoint, _ = fp8_pair(src, (128, 128))
    dev = torch.device("cuda")
    ids = torch.tensor(prompts_of_lengths([21], seed=3)[0], device=dev)

    def logits(path, quantization=None, tp=None):
        model = load_model(str(path), torch.bfloat16, dev, 64, quantization=quantization, tp=tp)
        o = model.layers[0].o
        assert isinstance(o, FP8Weight) and o.weight.shape == (256, 256 // (tp.world if tp else 1))
        allocate_kv(model, num_blocks=4, block_size=16)
        n = len(ids)
        meta = AttnMeta(positions=torch.arange(n, device=dev), slot_mapping=torch.arange(n, device=dev) + 16,
                        block_table=torch.tensor([[1, 2, 3, 0]], dtype=torch.int32, device=dev), T=n)
        with torch.no_grad():
            return model.logits(model.forward(ids, meta)).float()

    for path, quantization in ((checkpoint, None), (src, "fp8")):
        whole = logits(path, quantization)
        for rank, got in enumerate(on_threads(2, lambda m: logits(path, quantization, m))):
            err = ((got - whole).norm() / whole.norm()).item()
            assert err < 2e-2, (str(path), quantization, rank, err)
            assert (got.argmax(-1) == whole.argmax(-1)).float().mean() > 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_cuda_graphs_equal_eager_nccl(tmp_path, models):
    """tp 2 over NCCL with the TP all-reduces captured in the CUDA graphs (each process reports its graphs): float32
    tokens equal one GPU running eagerly, and the same job eagerly at tp 2."""
    from dp_util import run_in_process, same_tokens

    rows = [{"id": f"r{i}", "prompt": p, "max_tokens": n}
            for i, (p, n) in enumerate(zip(prompts_of_lengths([30, 4, 9, 13], seed=17), [30, 3, 12, 25]))]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    room = {"num_blocks": 512}
    ref = dp_config(tmp_path, models["target"], models["draft"], dp=1, M=M, D=D, device="cuda", cache=room,
                    enforce_eager=True, name="ref.yaml")
    run_in_process(ref, inp, tmp_path / "ref.jsonl")
    for eager in (False, True):
        cfg = dp_config(tmp_path, models["target"], models["draft"], dp=1, dp_sync="never", M=M, D=D, device="cuda",
                        cache=room, timeout_s=60, enforce_eager=eager, parallel={"tensor_parallel_size": 2},
                        name=f"tp{int(eager)}.yaml")
        out = tmp_path / f"out{int(eager)}.jsonl"
        r, _ = run_cli("generate", cfg, "--input", inp, "--output", out, "--summary-json", tmp_path / "s.json")
        assert r.returncode == 0, r.stderr[-3000:]
        assert same_tokens(read_out(tmp_path / "ref.jsonl"), read_out(out)) == []
        ranks = json.load(open(tmp_path / "s.json"))["ranks"]
        assert (ranks[0]["graphs"] > 0) != eager, ranks
