"""The GPU lane (marked `gpu`, skipped without CUDA; run on a GPU machine with
`python -m pytest -q -m gpu`): the Triton kernels against their torch references, CUDA graphs
against eager execution (identical greedy tokens in float32, also through preemption), and a
lockstep dp = 2 run over NCCL with every collective checked."""
import pytest
import torch

from dp_util import dp_config, read_out, run_cli, run_in_process, same_tokens, write_jsonl
from engine_util import hf_reference, make_config, prompts_of_lengths, run_engine
from helpers import make_eagle3_head, make_eagle_head

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(600)]


def rel(a, b) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_reference(dtype):
    from specdp_cli.runtime import ops
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x, w, r = rnd(7, 384), rnd(384), rnd(7, 384)
    assert rel(ops.rms_norm(x.cuda(), w.cuda(), 1e-6), ops.rms_norm(x, w, 1e-6)) < tol
    r1, r2 = r.cuda(), r.clone()
    assert rel(ops.rms_norm(x.cuda(), w.cuda(), 1e-6, r1), ops.rms_norm(x, w, 1e-6, r2)) < tol
    assert rel(r1, r2) < tol
    gu = rnd(5, 2 * 1000)
    assert rel(ops.silu_and_mul(gu.cuda()), ops.silu_and_mul(gu)) < tol

    H, KV, D, BS, NB = 6, 2, 64, 16, 12
    qkv = rnd(9, (H + 2 * KV) * D)
    cos, sin = torch.randn(200, D // 2, generator=g), torch.randn(200, D // 2, generator=g)
    pos = torch.randint(0, 200, (9,), generator=g)
    slots = torch.randperm(NB * BS, generator=g)[:9]
    meta = ops.AttnMeta(pos, slots, None)
    kc, vc = torch.zeros(NB, BS, KV, D, dtype=dtype), torch.zeros(NB, BS, KV, D, dtype=dtype)
    q_ref = qkv.clone()
    ops.rope_and_store(q_ref, cos, sin, meta, kc, vc, H, KV, D)
    q_gpu, kg, vg = qkv.cuda(), torch.zeros_like(kc).cuda(), torch.zeros_like(vc).cuda()
    ops.rope_and_store(q_gpu, cos.cuda(), sin.cuda(), ops.AttnMeta(pos.cuda(), slots.cuda(), None), kg, vg, H, KV, D)
    assert rel(q_gpu, q_ref) < tol and rel(kg, kc) < tol and rel(vg, vc) < tol

    # (4, 4, 24, 16): DeepSeek's latent attention caches keys wider than values
    for H, KV, D, DV in ((6, 2, 64, 64), (4, 4, 64, 64), (32, 8, 128, 128), (4, 2, 48, 48), (4, 4, 24, 16)):
        kc, vc = rnd(40, BS, KV, D).cuda(), rnd(40, BS, KV, DV).cuda()
        bt = torch.zeros(4, 16, dtype=torch.int32)
        perm = torch.randperm(39, generator=g) + 1
        bt[0, :5], bt[1, :3], bt[2, :10], bt[3, :10] = perm[:5], perm[5:8], perm[8:18], perm[8:18]
        bt = bt.cuda()
        for T in (1, 5, 16):
            # rows 2 and 3: one sequence's prompt cut into two rows; row 1 mostly padding
            start, n_real = torch.tensor([70, 20, 120, 120 + T]), torch.tensor([T, min(2, T), T, max(T - 3, 1)])
            p = (start[:, None] + torch.minimum(torch.arange(T)[None], (n_real - 1)[:, None])).view(-1).cuda()
            q = rnd(4 * T, H, D).cuda()
            for window in (None, 20):
                m = ops.AttnMeta(p, None, bt, T)
                assert rel(ops.paged_attention(q, kc, vc, m, 0.1, window),
                           ops._attention_reference(q, kc, vc, m, 0.1, window)) < tol, (H, KV, D, DV, T, window)
            sinks = (torch.randn(H, generator=g) * 3).to(dtype).cuda()        # GPT-OSS's per-head sink logits
            m = ops.AttnMeta(p, None, bt, T)
            assert rel(ops.paged_attention(q, kc, vc, m, 0.1, 20, sinks),
                       ops._attention_reference(q, kc, vc, m, 0.1, 20, sinks)) < tol, ("sinks", H, KV, D, DV, T)

    # small batch: each row's keys split over several programs and combined (attention_splits' automatic choice),
    # R = 1 over 1500 keys and R = 2 (one row short: most of its parts empty), T 1 and 4, a window, sinks; the
    # explicit single pass and splits agree with it
    from specdp_cli.runtime import triton_kernels as tk
    H, KV, D, DV = 32, 8, 128, 128
    kc, vc = rnd(300, BS, KV, D).cuda(), rnd(300, BS, KV, DV).cuda()
    bt = (torch.randperm(299, generator=g)[:2 * 128] + 1).view(2, 128).to(torch.int32).cuda()    # 2048 keys a row
    sinks = (torch.randn(H, generator=g) * 3).to(dtype).cuda()
    for R, starts in ((1, [1500]), (2, [1500, 30])):
        assert tk.attention_splits(R, KV, 1, H, DV, bt.shape[1] * BS, 64, tk._sm_count(kc.device)) > 1
        for T in (1, 4):
            p = (torch.tensor(starts)[:, None] + torch.arange(T)[None]).view(-1).cuda()
            q = rnd(R * T, H, D).cuda()
            m = ops.AttnMeta(p, None, bt[:R], T)
            for window, sk in ((None, None), (100, None), (None, sinks)):
                ref = ops._attention_reference(q, kc, vc, m, 0.1, window, sk)
                assert rel(ops.paged_attention(q, kc, vc, m, 0.1, window, sk), ref) < tol, ("split", R, T, window)
                for S in (1, 3, 16):
                    out = torch.empty_like(q)
                    tk.paged_attention(q, kc, vc, out, p, bt[:R], T, 0.1, window, sk, splits=S)
                    assert rel(out, ref) < tol, ("splits", S, R, T, window)

    # a partial rotary factor (Phi-4-mini: 0.75): the leading 3/4 of each head rotate (`rotate_` on CUDA), the rest not
    D, rot = 64, 48
    cos, sin = torch.randn(200, rot // 2, generator=g), torch.randn(200, rot // 2, generator=g)
    qkv = rnd(9, (H + 2 * KV) * D)
    kc, vc = torch.zeros(NB, BS, KV, D, dtype=dtype), torch.zeros(NB, BS, KV, D, dtype=dtype)
    q_ref = qkv.clone()
    ops.rope_and_store(q_ref, cos, sin, meta, kc, vc, H, KV, D)
    q_gpu, kg, vg = qkv.cuda(), torch.zeros_like(kc).cuda(), torch.zeros_like(vc).cuda()
    ops.rope_and_store(q_gpu, cos.cuda(), sin.cuda(), ops.AttnMeta(pos.cuda(), slots.cuda(), None), kg, vg, H, KV, D)
    assert rel(q_gpu, q_ref) < tol and rel(kg, kc) < tol
    assert torch.equal(q_ref.view(9, -1, D)[:, :, rot:], qkv.view(9, -1, D)[:, :, rot:])       # the rest passes through

    # rotation in place of a strided view (latent attention's rope part of each query head); per-head q/k norms
    q = rnd(9, 6, 24)
    cos, sin = torch.randn(200, 4, generator=g), torch.randn(200, 4, generator=g)
    q_ref, q_gpu = q.clone(), q.cuda()
    ops.rotate(q_ref[..., 16:], cos, sin, pos)
    ops.rotate(q_gpu[..., 16:], cos.cuda(), sin.cuda(), pos.cuda())
    assert rel(q_gpu, q_ref) < tol
    qkv, qw, kw = rnd(9, (H + 2 * KV) * D), rnd(D), rnd(D)
    q_ref, q_gpu = qkv.clone(), qkv.cuda()
    ops.head_rms_norm_(q_ref, qw, kw, H, KV, D, 1e-6)
    ops.head_rms_norm_(q_gpu, qw.cuda(), kw.cuda(), H, KV, D, 1e-6)
    assert rel(q_gpu, q_ref) < tol
    # the per-head norms inside the rotary kernel (Qwen3) = the norms, then rotation and store
    cos, sin = torch.randn(200, D // 2, generator=g), torch.randn(200, D // 2, generator=g)
    kc, vc = torch.zeros(NB, BS, KV, D, dtype=dtype), torch.zeros(NB, BS, KV, D, dtype=dtype)
    q_ref = qkv.clone()
    ops.rope_and_store(q_ref, cos, sin, meta, kc, vc, H, KV, D, (qw, kw, 1e-6))
    q_gpu, kg, vg = qkv.cuda(), torch.zeros_like(kc).cuda(), torch.zeros_like(vc).cuda()
    ops.rope_and_store(q_gpu, cos.cuda(), sin.cuda(), ops.AttnMeta(pos.cuda(), slots.cuda(), None), kg, vg, H, KV, D,
                       (qw.cuda(), kw.cuda(), 1e-6))
    assert rel(q_gpu, q_ref) < tol and rel(kg, kc) < tol and rel(vg, vc) < tol


def test_forward_layout_kernel_matches_reference():
    """A forward's positions, cache slots and logits rows: the Triton kernel against the torch reference
    (padding rows, rows past their block table, windows past a row's end)."""
    from types import SimpleNamespace

    from specdp_cli.runtime.model_runner import ModelRunner
    model = SimpleNamespace(vocab_size=8, embed=torch.zeros(1, 4), dtype=torch.float32)
    bt = torch.randint(1, 50, (6, 9), dtype=torch.int32)
    runners = [ModelRunner(model, torch.device(d), bt.to(d), 16, 6, [1, 5, 40], window=5) for d in ("cpu", "cuda")]
    for T in (1, 5, 40):
        start = torch.tensor([0, 15, 100, -1, 37, 130])
        n_real = torch.tensor([1, 5, 3, 0, 40, 2]).clamp(max=T)
        out_start = torch.tensor([0, 2, 4, 0, 35, 1]).clamp(max=T - 1)
        for r in runners:
            r.set_rows(6, start=start.to(r.device), n_real=n_real.to(r.device), out_start=out_start.to(r.device))
        ref, got = (r._layout(6, T) for r in runners)
        for a, b in zip(ref, got):
            assert torch.equal(a, b.cpu()), T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_input_copies_and_argmax_kernels(dtype):
    """ModelRunner.set_rows' one kernel against the CPU runner's torch copies (the staged table's strided columns,
    some arguments only, a bool n_real); ops.argmax against torch.argmax (ties, V past the block, a vocabulary of
    152k, 1 to 40 rows, 2-D / 3-D / a window column); both in a captured CUDA graph replayed on new inputs."""
    from types import SimpleNamespace

    from specdp_cli.runtime import ops
    from specdp_cli.runtime.model_runner import ModelRunner
    g = torch.Generator().manual_seed(0)
    model = SimpleNamespace(vocab_size=8, embed=torch.zeros(1, 4), dtype=dtype)
    bt = torch.zeros(8, 4, dtype=torch.int32)
    cpu, gpu = (ModelRunner(model, torch.device(d), bt.to(d), 16, 8, [1, 3, 40], window=1) for d in ("cpu", "cuda"))
    table = torch.randint(0, 10 ** 6, (8, 100), generator=g)
    tg = table.cuda()
    calls = [lambda t, R: ((t[:R, 2:42], t[:R, 80], t[:R, 81], t[:R, 82]), {}),
             lambda t, R: ((t[:R, 5:8],), dict(n_real=t[:R, 90] > 5 * 10 ** 5)),
             lambda t, R: ((), dict(start=t[:R, 3] - 1, out_start=t[:R, 9])),
             lambda t, R: ((t[:R, 7].view(R, 1),), {})]
    for R in (1, 5, 8):
        for call in calls:
            for r, t in ((cpu, table), (gpu, tg)):
                args, kw = call(t, R)
                r.set_rows(R, *args, **kw)
            for a, b in ((cpu.ids, gpu.ids), (cpu.start, gpu.start), (cpu.n_real, gpu.n_real),
                         (cpu.out_start, gpu.out_start)):
                assert torch.equal(a, b.cpu()), R

    for shape in ((1, 16384), (1, 151936), (3, 16384), (40, 32000), (2, 4, 1000), (5, 129)):
        x = torch.randn(*shape, generator=g).to(dtype).cuda()
        x.view(-1, shape[-1])[0, [7, shape[-1] // 2, shape[-1] - 1]] = 100      # ties: the first wins
        assert torch.equal(ops.argmax(x), x.argmax(-1)), shape
    x = torch.randn(4, 3, 50000, generator=g).round().to(dtype).cuda()        # many ties
    assert torch.equal(ops.argmax(x[:, 1]), x[:, 1].argmax(-1)) and torch.equal(ops.argmax(x), x.argmax(-1))

    logits = torch.randn(5, 3, 16384, device="cuda").to(dtype)
    args, kw = calls[0](tg, 5)
    gpu.set_rows(5, *args, **kw)                                 # compiled before the capture
    ops.argmax(logits)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.set_rows(5, *args, **kw)
        out = ops.argmax(logits)
    tg.random_(0, 10 ** 6)
    logits.normal_()
    graph.replay()
    cpu.set_rows(5, *calls[0](tg.cpu(), 5)[0])
    assert torch.equal(gpu.ids[:5 * 40], cpu.ids[:5 * 40].cuda()) and torch.equal(gpu.start[:5], tg[:5, 80])
    assert torch.equal(out, logits.argmax(-1))


def cuda_engine(cfg, plan):
    from specdp_cli.runtime.dist import DPGroup
    from specdp_cli.runtime.engine import Engine
    return Engine(cfg, plan, DPGroup.solo(), torch.device("cuda", 0))


# engines of one process share the GPU: each takes a fixed KV cache instead of most of the memory
ROOM = {"num_blocks": 512}


@pytest.mark.parametrize("method", ["draft_model", "ngram", "none", "eagle", "eagle3"])
def test_graphs_equal_eager_float32(models, method, tmp_path):
    prompts = prompts_of_lengths([3, 9, 17, 26, 33, 41, 50, 57, 62])
    kw = dict(method=method, k=3, M=64, max_num_seqs=4, max_batched=24, device="cuda", cache=ROOM,
              speculative={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    drafter = {"eagle": lambda: make_eagle_head(tmp_path / "eagle", models["target"]),
               "eagle3": lambda: make_eagle3_head(tmp_path / "eagle3", models["target"], draft_vocab=96)}.get(
        method, lambda: models["draft"])()
    out = {}
    for eager in (True, False):
        cfg, plan = make_config(models["target"], drafter, enforce_eager=eager, **kw)
        engine = cuda_engine(cfg, plan)
        out[eager] = run_engine(engine, prompts, max_tokens=30)
        sampled = run_engine(engine, prompts, max_tokens=20, temperature=0.8, top_p=0.95, seed=5)
        out[eager, "sampled"] = [sampled[i].generated for i in range(len(prompts))]
        assert (engine.graphs == 0) == eager
    for i, p in enumerate(prompts):
        assert out[False][i].generated == out[True][i].generated, i
        assert out[False][i].generated == hf_reference(models["target"], p, min(30, 64 - len(p))), i
    assert out[False, "sampled"] == out[True, "sampled"]


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_graphs_per_k_equal_eager_with_k_toggling(models, method, tmp_path, monkeypatch):
    """A step k toggling through 0 (the spec-length test hook) replays the graph of each k; greedy
    float32 tokens equal eager ones and the target's."""
    from specdp_cli.runtime.spec_length import TEST_ENV
    monkeypatch.setenv(TEST_ENV, "0:3,0,0,1,2," + ",".join(["0"] * 18) + ",3")
    prompts = prompts_of_lengths([3, 9, 17, 26, 33])
    drafter = make_eagle_head(tmp_path / "eagle", models["target"]) if method == "eagle" else models["draft"]
    out = {}
    for eager in (True, False):
        cfg, plan = make_config(models["target"], drafter, method=method, k=3, M=64, max_num_seqs=4, max_batched=64,
                                device="cuda", cache=ROOM, enforce_eager=eager, speculative={"adaptive": True})
        engine = cuda_engine(cfg, plan)
        out[eager] = run_engine(engine, prompts, max_tokens=30)
        assert engine.spec_len.used[0] and engine.spec_len.used[3]
        if not eager:       # decode steps and steps with prompt chunks, at every k
            assert {key[1] for key in engine.step_graphs if key[3] == key[2]} >= {0, 1, 2, 3}
            assert {key[1] for key in engine.step_graphs if key[3] == engine.T_chunk} >= {0, 1, 2, 3}
    for i, p in enumerate(prompts):
        assert out[False][i].generated == out[True][i].generated == hf_reference(models["target"], p, 30), i


def test_graphs_through_preemption(models):
    prompts = prompts_of_lengths([5, 14, 23, 9, 30, 18, 11, 26], seed=7)
    kw = dict(k=3, M=64, max_num_seqs=6, max_batched=64, device="cuda")
    roomy = run_engine(cuda_engine(*make_config(models["target"], models["draft"], cache=ROOM, **kw)), prompts,
                       max_tokens=30)
    tight_engine = cuda_engine(*make_config(models["target"], models["draft"], cache={"block_size": 4, "num_blocks": 24}, **kw))
    tight = run_engine(tight_engine, prompts, max_tokens=30)
    assert tight_engine.counters.preemptions > 0 and tight_engine.graphs > 0
    assert [tight[i].generated for i in range(8)] == [roomy[i].generated for i in range(8)]


def test_async_scheduling_equals_sync_in_graphs(models, tmp_path):
    """Async scheduling on the GPU (the step planned ahead, its tokens fed on the device, results through pinned
    buffers and events) against the synchronous engine, both in CUDA graphs, float32: greedy (sequences reaching M,
    some stopping on eos), seeded sampling, and a pool small enough to preempt."""
    from engine_util import eos_variant
    prompts = prompts_of_lengths([3, 9, 17, 26, 33, 41, 50, 57, 62])
    target = eos_variant(models["target"], prompts, tmp_path / "t")
    out = {}
    for on in (False, True):
        for cache in (ROOM, {"block_size": 4, "num_blocks": 40}):
            cfg, plan = make_config(target, method="none", M=64, max_num_seqs=4, max_batched=24, device="cuda",
                                    cache=cache, scheduler={"async_scheduling": on})
            engine = cuda_engine(cfg, plan)
            assert engine.async_sched is on and engine.graphs > 0
            greedy = run_engine(engine, prompts, max_tokens=30)
            sampled = run_engine(engine, prompts, max_tokens=20, temperature=0.8, top_p=0.95, seed=5)
            out[on, cache["num_blocks"]] = [(greedy[i].generated, greedy[i].finish_reason, sampled[i].generated)
                                            for i in range(len(prompts))]
            assert (engine.counters.planned_ahead > engine.counters.steps // 2) is on
            if cache is not ROOM:
                assert engine.counters.preemptions > 0
    assert any(r[1] == "stop" for r in out[False, 512])
    assert out[True, 512] == out[False, 512] == out[True, 40] == out[False, 40]


@pytest.mark.parametrize("method", ["eagle", "mtp", "draft_model"])
def test_async_drafting_equals_sync_in_graphs(models, method, tmp_path):
    """An EAGLE head, an MTP layer and a draft model with async scheduling in CUDA graphs (each step's drafts or
    catch-up tokens and rejected counts fed to the next on the device) against the synchronous engine, float32:
    greedy equal to transformers (the no-draft window crossed: D = 40), seeded sampling equal, and a pool small
    enough to preempt."""
    from helpers import make_deepseek_dir
    prompts = prompts_of_lengths([3, 9, 17, 26, 33, 41, 50, 57, 62])
    if method == "eagle":
        target, head, D = models["target"], make_eagle_head(tmp_path / "eagle", models["target"]), 40
    elif method == "draft_model":
        target, head, D = models["target"], models["draft"], 40
    else:
        target, head, D = make_deepseek_dir(tmp_path / "mtp", models["tokenizer"], seed=3), None, None
    tight = {"block_size": 4, "num_blocks": 40 if method == "mtp" else 48}     # each preempts (host logic: CPU-checked)
    out = {}
    for on in (False, True):
        for cache in (ROOM, tight):
            cfg, plan = make_config(target, head, method=method, k=3, M=64, D=D, max_num_seqs=4, max_batched=24,
                                    device="cuda", cache=cache, scheduler={"async_scheduling": on})
            engine = cuda_engine(cfg, plan)
            assert engine.async_sched is on and engine.graphs > 0
            greedy = run_engine(engine, prompts, max_tokens=30)
            sampled = run_engine(engine, prompts, max_tokens=20, temperature=0.8, top_p=0.95, seed=5)
            out[on, cache["num_blocks"]] = [(greedy[i].generated, sampled[i].generated) for i in range(len(prompts))]
            assert (engine.counters.planned_ahead > engine.counters.steps // 2) is on
            if cache is not ROOM:
                assert engine.counters.preemptions > 0
    n = tight["num_blocks"]
    assert out[True, 512] == out[False, 512] == out[True, n] == out[False, n]
    for i, p in enumerate(prompts):
        assert out[True, 512][i][0] == hf_reference(target, p, min(30, 64 - len(p))), i


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_lockstep_dp2_nccl_with_checked_collectives(tmp_path, models):
    rows = [{"prompt": f"def f{i}(x):\n    return x *", "max_tokens": 4 + 5 * i} for i in range(5)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = dp_config(tmp_path, models["target"], models["draft"], dp=2, dp_sync="always", check=True, device="cuda",
                    timeout_s=60, cache=ROOM)
    run_in_process(cfg, inp, tmp_path / "ref.jsonl")
    r, _ = run_cli("generate", cfg, "--input", inp, "--output", tmp_path / "out.jsonl", "--summary-json",
                   tmp_path / "s.json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert same_tokens(read_out(tmp_path / "ref.jsonl"), read_out(tmp_path / "out.jsonl")) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k,held", [(1, 128, 8, None), (5, 32, 4, None), (64, 16, 2, None),
                                                         (300, 64, 8, None), (37, 64, 4, (20, 41))])
@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_routed_expert_kernels_match_reference(dtype, tokens, experts, top_k, held, act):
    """The grouped Triton kernels against the MoE's torch reference (each chosen expert once over its tokens):
    small and large batches, many experts, a held subset (expert parallelism: the others contribute nothing),
    SiLU-and-mul and GPT-OSS's clamped SwiGLU with biases."""
    from specdp_cli.runtime.models.gpt_oss import GptOssMoE
    from specdp_cli.runtime.models.moe import MoE
    g = torch.Generator().manual_seed(tokens + experts)
    H, I = 256, 96
    lo, hi = held or (0, experts)
    E = hi - lo

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).cuda()

    gate_up, down = rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5)
    kw = dict(gate_up_bias=rnd(E, 2 * I), down_bias=rnd(E, H)) if act == "swiglu_oai" else {}
    moe = (GptOssMoE if act == "swiglu_oai" else MoE)(None, gate_up, down, True, range(lo, hi), **kw)
    x = rnd(tokens, H)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).cuda() - lo
    w = torch.softmax(torch.randn(tokens, top_k, generator=g), -1).cuda()
    ref = moe.routed_reference(x, w, idx)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel(moe.routed_kernel(x, w, idx), ref) < tol                 # the tiles the size picks
    from specdp_cli.runtime.moe_kernels import routed_experts
    kw = dict(act=act, alpha=moe.alpha, limit=moe.limit, **kw) if act == "swiglu_oai" else {}
    for tile in (dict(BLOCK_M=64, UP_N=64, DOWN_N=128, BLOCK_K=32, warps=8, stages=2),       # taller blocks
                 dict(BLOCK_M=16, UP_N=16, DOWN_N=32, BLOCK_K=64, warps=4, stages=3)):
        assert rel(routed_experts(x, w, idx, gate_up, down, tile=tile, **kw), ref) < tol, tile
    graph = torch.cuda.CUDAGraph()            # fixed sizes, no host sync: a CUDA graph holds it
    moe.routed_kernel(x, w, idx)
    with torch.cuda.graph(graph):
        out = moe.routed_kernel(x, w, idx)
    idx.copy_(idx.flip(0))                    # new routing, same buffers
    x.copy_(x.flip(0))
    graph.replay()
    assert rel(out, moe.routed_reference(x, w, idx)) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_routing_kernels_match_reference():
    """Softmax top-k (Mixtral, Qwen3-MoE) and DeepSeek-V3's grouped sigmoid routing in one kernel each: the same
    experts and weights as the torch reference."""
    from specdp_cli.runtime.models.deepseek_v3 import SigmoidRouting
    from specdp_cli.runtime.models.moe import SoftmaxTopK
    g = torch.Generator().manual_seed(0)
    for route in (SoftmaxTopK(torch.randn(128, 64, generator=g), 8, True),
                  SoftmaxTopK(torch.randn(8, 64, generator=g), 2, False),
                  SigmoidRouting(torch.randn(256, 64, generator=g), 0.3 * torch.randn(256, generator=g), 8, True, 8, 4,
                                 2.5),
                  SigmoidRouting(torch.randn(24, 64, generator=g), 0.3 * torch.randn(24, generator=g), 3, False, 3, 2,
                                 1.0)):
        x = torch.randn(33, 64, generator=g)
        w0, i0 = route(x)
        for f in ("router", "bias"):
            if hasattr(route, f):
                setattr(route, f, getattr(route, f).cuda())
        w1, i1 = route(x.cuda())
        a, b = i0.sort(-1), i1.cpu().sort(-1)
        assert torch.equal(a.values, b.values)
        assert torch.allclose(w0.gather(1, a.indices), w1.cpu().gather(1, b.indices), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_kernel_matches_linear(dtype):
    """The router's matrix-vector kernel (up to ROUTER_MAX_TOKENS tokens) against F.linear: float32 within
    rounding, bf16 logits equal (a rare one an ulp off: another order of the float32 sums); DeepSeek's float32
    logits from bf16 activations and a float32 router; a CUDA graph replays it on new activations."""
    import torch.nn.functional as F
    from specdp_cli.runtime.moe_kernels import ROUTER_MAX_TOKENS, router_logits
    g = torch.Generator().manual_seed(0)
    for N, E, H in ((1, 128, 2048), (3, 128, 2048), (8, 60, 1000), (ROUTER_MAX_TOKENS, 256, 7168)):
        x = torch.randn(N, H, generator=g).to(dtype).cuda()
        router = (torch.randn(E, H, generator=g) * H ** -0.5).to(dtype).cuda()
        out, ref = router_logits(x, router), F.linear(x, router)
        assert out.dtype == dtype
        if dtype == torch.float32:
            assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (N, (out - ref).abs().max())
        else:
            assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7).all(), N     # an ulp at most
            assert (out == ref).float().mean() > 0.95, (N, (out == ref).float().mean())
        out32 = router_logits(x, router.float(), torch.float32)
        assert torch.allclose(out32, F.linear(x.float(), router.float()), rtol=1e-5, atol=1e-5), N
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_logits(x, router)
    x.copy_(x.flip(0) * 2)
    graph.replay()
    assert torch.equal(out, router_logits(x, router))


def test_one_row_output_projection_matches_linear():
    """ops.linear_one_row (the attention output projection): one row by a bf16 / fp16 weight runs the matrix-vector
    kernel (Qwen3-30B-A3B's and Llama-8B's o shapes, and odd sizes), within a bf16 / fp16 ulp of the float32
    product and of F.linear; float32, two rows, a bias or a weight past ONE_ROW_MAX_WEIGHT keep F.linear; a CUDA
    graph captured at one row replays the kernel on new activations."""
    import torch.nn.functional as F
    from specdp_cli.runtime import gemv_kernels, ops
    g = torch.Generator().manual_seed(0)
    for dtype, ulp in ((torch.bfloat16, 2 ** -7), (torch.float16, 2 ** -10)):
        for N, K in ((2048, 4096), (4096, 4096), (96, 200), (1000, 3000)):
            x = torch.randn(1, K, generator=g).to(dtype).cuda()
            w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).cuda()
            out = ops.linear_one_row(x, w)
            assert out.dtype == dtype and torch.equal(out, gemv_kernels.gemv(x, w)), (dtype, N, K)   # the kernel ran
            ref = F.linear(x.float(), w.float())
            assert torch.allclose(out.float(), ref, rtol=ulp, atol=1e-3), (dtype, N, K, (out.float() - ref).abs().max())
            assert rel(out, F.linear(x, w)) < 1e-2, (dtype, N, K)
    x, w = torch.randn(2, 512, generator=g).cuda(), torch.randn(256, 512, generator=g).cuda() / 20
    b = torch.randn(256, generator=g).cuda()
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(ops.linear_one_row(x[:1], w), F.linear(x[:1], w))                    # float32
    assert torch.equal(ops.linear_one_row(xb, wb), F.linear(xb, wb))                        # two rows
    assert torch.equal(ops.linear_one_row(xb[:1], wb, b.bfloat16()), F.linear(xb[:1], wb, b.bfloat16()))
    big = torch.randn(4096, 4104, device="cuda", dtype=torch.bfloat16)
    xbig = torch.randn(1, 4104, device="cuda", dtype=torch.bfloat16)
    assert big.numel() > gemv_kernels.ONE_ROW_MAX_WEIGHT
    assert torch.equal(ops.linear_one_row(xbig, big), F.linear(xbig, big))
    x1 = xb[:1].clone()
    ops.linear_one_row(x1, wb)                                   # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear_one_row(x1, wb)
    x1.copy_(x1.flip(1) * 2)
    graph.replay()
    assert torch.equal(out, gemv_kernels.gemv(x1, wb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 8), (5, 8), (16, 8), (17, 8), (40, 2), (100, 2)])
def test_moe_small_routing_paths(dtype, tokens, top_k):
    """A softmax top-k MoE on CUDA through MoE.__call__: the router's matrix-vector kernel (up to ROUTER_MAX_TOKENS
    tokens), the small align (up to SMALL_P pairs; beyond: `_align_kernel`), a held subset of the experts (the
    others held elsewhere). Valid groupings from both aligns, the sum of the reference, and a CUDA graph replays it
    on new activations as eager runs it."""
    from test_kernels_interpreted import check_grouping
    from specdp_cli.runtime.models.moe import MoE, SoftmaxTopK
    from specdp_cli.runtime.moe_kernels import align, block_m
    g = torch.Generator().manual_seed(tokens)
    E, H, I, lo, hi = 64, 256, 96, 16, 48

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).cuda()

    moe = MoE(SoftmaxTopK(rnd(E, H, scale=H ** -0.5), top_k, True), rnd(hi - lo, 2 * I, H, scale=H ** -0.5),
              rnd(hi - lo, H, I, scale=I ** -0.5), False, range(lo, hi))
    x = rnd(tokens, H)
    w, idx = moe.route(x)
    held = idx - lo
    bm = block_m(idx.numel(), hi - lo)
    for small in (True, False):
        check_grouping(held.view(-1).cpu(), hi - lo, bm, *(t.cpu() for t in align(held.view(-1), hi - lo, bm, small)))
    out = moe(x)
    ref = moe.routed_reference(x, w.to(dtype), held)
    assert rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)
    x.copy_(x.flip(0) * 2)
    graph.replay()
    assert torch.equal(out, moe(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_sum_fused_with_add_and_norm(dtype):
    """The routed pairs' sum fused with the residual add and the next RMSNorm (moe_kernels.sum_add_rms_norm, what
    the decoder runs after a MoE) against the sum kernel then rms_norm: the same residual and norm bit for bit
    (Qwen3-30B-A3B's and DeepSeek-V3's layer shapes, a non-power-of-two hidden, pairs held elsewhere, without a
    norm, quantized for an FP8 linear); through MoE.__call__ (unsummed where nothing else adds to the sum) and in a CUDA graph."""
    from specdp_cli.runtime import triton_kernels as tk
    from specdp_cli.runtime.models.moe import MoE, RoutedPairs, SoftmaxTopK
    from specdp_cli.runtime.moe_kernels import sum_add_rms_norm, sum_pairs
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).cuda()

    for N, K, E, H in ((1, 8, 128, 2048), (16, 8, 128, 2048), (3, 8, 256, 7168), (5, 2, 8, 1000)):
        y, res, w = rnd(N * K, H), rnd(N, H), rnd(H)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]).cuda()
        idx[0, 1] = -1                                    # held on another rank: its row of y is skipped
        r1, r2 = res.clone(), res.clone()
        want = tk.rms_norm(sum_pairs(y, idx, E), w, 1e-6, r1)
        got = sum_add_rms_norm(y, idx, E, r2, w, 1e-6)
        assert torch.equal(r2, r1), (N, H, (r2 - r1).abs().max())
        assert torch.equal(got, want), (N, H, (got.float() - want.float()).abs().max())
        r2 = res.clone()
        assert sum_add_rms_norm(y, idx, E, r2, None, 1e-6) is None and torch.equal(r2, r1)
        if H % 128 == 0:             # quantized for an FP8 linear: quantize_activations' numbers of the plain norm
            from specdp_cli.runtime.fp8_kernels import quantize_activations
            r2 = res.clone()
            fused = sum_add_rms_norm(y, idx, E, r2, w, 1e-6, quantize=True)
            q, s = quantize_activations(want)
            assert torch.equal(r2, r1) and torch.equal(fused.q.float(), q.float()) and torch.equal(fused.scale, s)

    E, H, I = 64, 2048, 96
    moe = MoE(SoftmaxTopK(rnd(E, H, scale=H ** -0.5), 8, True), rnd(E, 2 * I, H, scale=H ** -0.5),
              rnd(E, H, I, scale=I ** -0.5), False, range(E))
    x, res, w = rnd(4, H), rnd(4, H), rnd(H)
    r1, r2 = res.clone(), res.clone()
    want = tk.rms_norm(moe(x), w, 1e-6, r1)
    pairs = moe(x, unsummed=True)
    assert isinstance(pairs, RoutedPairs)
    assert torch.equal(pairs.add_to(r2, w, 1e-6), want) and torch.equal(r2, r1)
    moe.shared_gate_up, moe.shared_down = rnd(2 * I, H, scale=H ** -0.5), rnd(H, I, scale=I ** -0.5)
    assert isinstance(moe(x, unsummed=True), torch.Tensor)         # shared experts add to the sum: summed here
    moe.shared_gate_up = moe.shared_down = None
    graph = torch.cuda.CUDAGraph()
    r2 = res.clone()
    with torch.cuda.graph(graph):
        out = moe(x, unsummed=True).add_to(r2, w, 1e-6)
    r2.copy_(res)
    graph.replay()
    assert torch.equal(out, want) and torch.equal(r2, r1)


@pytest.mark.parametrize("family,method", [("mixtral", "draft_model"), ("qwen3_moe", "draft_model"),
                                           ("deepseek_v3", "draft_model"), ("deepseek_v3", "mtp")])
def test_moe_graphs_equal_eager_float32(models, tmp_path, family, method):
    """MoE targets with many more experts than top-k, their routed experts in the grouped kernels inside CUDA
    graphs: Mixtral (32 experts, top 2), Qwen3-MoE (64, top 8), DeepSeek-V3 (32 routed experts in 4 groups, top 4
    of the best 2 groups, its latent attention and shared expert), with a drafter model or its own MTP layer."""
    from helpers import make_deepseek_dir, make_moe_dir

    tok = models["tokenizer"]
    target = {"mixtral": lambda: make_moe_dir(tmp_path / family, tok, "mixtral", seed=3, experts=32),
              "qwen3_moe": lambda: make_moe_dir(tmp_path / family, tok, "qwen3_moe", seed=4, experts=64, top_k=8,
                                                norm_topk_prob=True),
              "deepseek_v3": lambda: make_deepseek_dir(tmp_path / family, tok, seed=3, experts=32, top_k=4, n_group=4,
                                                       topk_group=2)}[family]()
    prompts = prompts_of_lengths([3, 9, 17, 26, 33])
    kw = dict(method=method, k=3, M=64, max_num_seqs=4, max_batched=24, device="cuda", cache=ROOM)
    out = {}
    for eager in (True, False):
        cfg, plan = make_config(target, models["draft"] if method == "draft_model" else None, enforce_eager=eager, **kw)
        engine = cuda_engine(cfg, plan)
        out[eager] = run_engine(engine, prompts, max_tokens=30)
        assert (engine.graphs == 0) == eager
    for i, p in enumerate(prompts):
        assert out[False][i].generated == out[True][i].generated == hf_reference(target, p, min(30, 64 - len(p))), i


@pytest.mark.parametrize("family", ["gemma3", "phi3", "olmo2", "gpt_oss"])
def test_new_families_graphs_equal_eager_float32(models, tmp_path, family):
    """Gemma-3 (sandwich norms, per-layer rotary tables, windows), Phi-3 (fused projections, a partial rotary
    factor: rotated in plain torch), OLMo-2 (post-norms, whole-projection q/k norms) and GPT-OSS (attention
    sinks in the Triton kernel, biases, its MoE) inside CUDA graphs, with a draft model: greedy float32 tokens
    equal eager ones and transformers'."""
    from test_gemma3 import make_gemma3_dir
    from test_gpt_oss import DEFAULT, make_gpt_oss_dir
    from test_olmo2 import make_olmo2_dir
    from test_phi3 import make_phi3_dir

    tok = models["tokenizer"]
    target = {"gemma3": lambda: make_gemma3_dir(tmp_path / family, tok, seed=5, sliding_window=8,
                                                layer_types=["sliding_attention", "full_attention"] * 2),
              "phi3": lambda: make_phi3_dir(tmp_path / family, tok, seed=7, sliding_window=16,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.75}),
              "olmo2": lambda: make_olmo2_dir(tmp_path / family, tok, seed=3, kv_heads=2),
              # swiglu_limit 7 (the released models'): transformers 5.17, on the GPU machines, ignores the config's
              "gpt_oss": lambda: make_gpt_oss_dir(tmp_path / family, tok, DEFAULT, seed=3, limit=7.0)}[family]()
    prompts = prompts_of_lengths([3, 9, 17, 26, 33])
    kw = dict(method="draft_model", k=3, M=64, max_num_seqs=4, max_batched=24, device="cuda", cache=ROOM)
    out = {}
    for eager in (True, False):
        cfg, plan = make_config(target, models["draft"], enforce_eager=eager, **kw)
        engine = cuda_engine(cfg, plan)
        out[eager] = run_engine(engine, prompts, max_tokens=30)
        assert (engine.graphs == 0) == eager
    for i, p in enumerate(prompts):
        assert out[False][i].generated == out[True][i].generated == hf_reference(target, p, min(30, 64 - len(p))), i


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("family,method", [("qwen3_moe", "draft_model"), ("deepseek_v3", "mtp")])
def test_expert_parallel_in_cuda_graphs_nccl(tmp_path, models, family, method):
    """Experts split over dp 2 on NCCL, the MoE layers' all-gather and reduce-scatter inside the CUDA graphs
    (each rank reports its graphs: no eager fallback): float32 tokens equal one GPU holding every expert, eager."""
    from helpers import make_deepseek_dir, make_moe_dir

    tok = models["tokenizer"]
    target = (make_moe_dir(tmp_path / family, tok, "qwen3_moe", seed=4, experts=32, top_k=4, norm_topk_prob=True)
              if family == "qwen3_moe" else make_deepseek_dir(tmp_path / family, tok, seed=3, experts=16, top_k=4,
                                                              n_group=4, topk_group=2))
    rows = [{"id": f"r{i}", "prompt": f"def f{i}(x):\n    return x *", "max_tokens": 4 + 5 * i} for i in range(5)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    draft = models["draft"] if method == "draft_model" else None
    ref = dp_config(tmp_path, target, draft, dp=1, dp_sync="auto", method=method, device="cuda", cache=ROOM,
                    enforce_eager=True, name="ref.yaml")
    cfg = dp_config(tmp_path, target, draft, dp=2, dp_sync="auto", method=method, device="cuda", cache=ROOM,
                    timeout_s=60, parallel={"enable_expert_parallel": True})
    run_in_process(ref, inp, tmp_path / "ref.jsonl")
    r, _ = run_cli("generate", cfg, "--input", inp, "--output", tmp_path / "out.jsonl", "--summary-json",
                   tmp_path / "s.json")
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    ranks = json.load(open(tmp_path / "s.json"))["ranks"]
    assert len(ranks) == 2 and all(r["graphs"] > 0 for r in ranks), ranks
    assert same_tokens(read_out(tmp_path / "ref.jsonl"), read_out(tmp_path / "out.jsonl")) == []


def test_fp8_checkpoint_graphs_equal_eager_float32(models, tmp_path):
    """A block-FP8 DeepSeek-V3 checkpoint (with its MTP layer) dequantized on the GPU as it loads: greedy float32
    tokens with graphs equal eager ones and transformers' on the dequantized weights."""
    from helpers import make_deepseek_dir
    from test_fp8 import fp8_pair

    src = make_deepseek_dir(tmp_path / "ds", models["tokenizer"], seed=3, experts=8, top_k=2, n_group=2, topk_group=1)
    target, ref = fp8_pair(src, (32, 16))
    prompts = prompts_of_lengths([3, 9, 17, 26, 33])
    out = {}
    for eager in (True, False):
        cfg, plan = make_config(target, None, method="mtp", k=3, M=64, max_num_seqs=4, max_batched=24, device="cuda",
                                cache=ROOM, enforce_eager=eager)
        out[eager] = run_engine(cuda_engine(cfg, plan), prompts, max_tokens=30)
    for i, p in enumerate(prompts):
        assert out[False][i].generated == out[True][i].generated == hf_reference(ref, p, min(30, 64 - len(p))), i


def _fp8_reference(x, wq, ws, rows, bias=None):
    """W8A8 in float64: x quantized per token and 128 columns (torch's float8 rounding), both dequantized."""
    from specdp_cli.runtime.models.quant import dequantize
    M, K = x.shape
    G = -(-K // 128)
    xp = torch.zeros(M, G * 128, device=x.device)
    xp[:, :K] = x.float()
    s = (xp.view(M, G, 128).abs().amax(-1) / 448).clamp(min=1e-12)
    q = (xp.view(M, G, 128) / s[..., None]).clamp(-448, 448).view(M, G * 128)[:, :K].to(torch.float8_e4m3fn)
    y = dequantize(q, s, (1, 128), torch.float64) @ dequantize(wq, ws, (rows, 128), torch.float64).t()
    return (y + bias.double() if bias is not None else y), q, s


@pytest.mark.parametrize("M", [1, 7, 16, 33, 64, 80, 200])
def test_fp8_gemm_matches_reference(M):
    """The block-scaled FP8 GEMM (activations quantized inside for decode sizes, by quantize_activations before
    it; split K; per-row weight scales; partial blocks; bias), the GEMV of few rows, and cuBLAS's where torch
    has it, against float64 W8A8; inside a CUDA graph too."""
    from specdp_cli.runtime import fp8_kernels as fk
    from specdp_cli.runtime.models.quant import quantize_blocks
    g = torch.Generator(device="cuda").manual_seed(M)
    for N, K, rows, bias in ((4096, 4096, 128, False), (576, 7168, 128, True), (200, 300, 1, True)):
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        wq, ws = quantize_blocks(torch.randn(N, K, device="cuda", generator=g))
        if rows == 1:
            ws = ws.repeat_interleave(128, 0)[:N].contiguous() * torch.rand(N, 1, device="cuda", generator=g)
        b = torch.randn(N, device="cuda", generator=g).bfloat16() if bias else None
        ref, q, s = _fp8_reference(x, wq, ws, rows, b)
        q2, s2 = fk.quantize_activations(x)
        assert torch.allclose(s2, s, rtol=1e-6, atol=0) and (q2.float() == q.float()).float().mean() > 0.999
        for xin, xs in ((x, None), (q2, s2)):
            y = fk.block_fp8_gemm(xin, wq, ws, rows, b, x_scale=xs, out_dtype=torch.bfloat16)
            assert rel(y, ref) < 5e-3, (M, N, K, rows, xs is None, rel(y, ref))
        if 64 < M < 128:                     # verification rows on decode-style tiles of 16 / 32 / 64-row blocks
            for bm in (16, 32, 64):
                t = dict(fk.tiles(M, N, K, 132), BLOCK_M=bm, GROUP_M=-(-M // bm))
                y = fk.block_fp8_gemm(q2, wq, ws, rows, b, x_scale=s2, out_dtype=torch.bfloat16, tile=t)
                assert rel(y, ref) < 5e-3, ("verify tile", bm, M, N, K, rows, rel(y, ref))
        if M < 128:                          # the product computed transposed (SWAP), 64 and 128 weight rows a program
            base = dict(BLOCK_M=max(16, 1 << (M - 1).bit_length()), SPLIT=4, stages=4, GROUP_M=1, SWAP=True)
            for t in (dict(base, BLOCK_N=64, warps=4), dict(base, BLOCK_N=128, warps=8, SPLIT=1),
                      dict(base, BLOCK_N=64, warps=4, AHEAD=True), dict(fk.tiles(M, N, K, 132), AHEAD=True)):
                y = fk.block_fp8_gemm(q2, wq, ws, rows, b, x_scale=s2, out_dtype=torch.bfloat16, tile=t)
                assert rel(y, ref) < 5e-3, ("swap / ahead tile", t, M, N, K, rows, rel(y, ref))
            y = fk.block_fp8_gemm(x, wq, ws, rows, b, out_dtype=torch.bfloat16, tile=dict(base, BLOCK_N=64, warps=4))
            assert rel(y, ref) < 5e-3, ("swap tile, quantized inside", M, N, K, rows, rel(y, ref))
        from specdp_cli.runtime.models.quant import dequantize
        y = fk.block_fp8_gemm(x, wq, ws, rows, b, mode="weight_only")         # W8A16: x as it is
        w16 = x.double() @ dequantize(wq, ws, (rows, 128), torch.float64).t() + (b.double() if bias else 0)
        assert rel(y, w16) < 5e-3, ("weight_only", M, N, K, rows, rel(y, w16))
        if M < 128:                          # W8A16 on a swapped tile
            t = dict(BLOCK_M=max(16, 1 << (M - 1).bit_length()), BLOCK_N=64, SPLIT=4, warps=4, stages=4, GROUP_M=1,
                     SWAP=True)
            y = fk.block_fp8_gemm(x, wq, ws, rows, b, mode="weight_only", tile=t)
            assert rel(y, w16) < 5e-3, ("weight_only swapped", M, N, K, rows, rel(y, w16))
        if M <= 16:                          # the one-kernel GEMV of few rows, W8A8 and W8A16, each tile shape
            for t in (None, dict(BLOCK_N=8, GROUPS=1, warps=4, stages=2), dict(BLOCK_N=32, GROUPS=4, warps=8, stages=3)):
                y = fk.block_fp8_gemv(x, wq, ws, rows, b, tile=t)
                assert rel(y, ref) < 5e-3, ("gemv", t, M, N, K, rows, rel(y, ref))
                y = fk.block_fp8_gemv(x, wq, ws, rows, b, tile=t, quantize_x=False)
                assert rel(y, w16) < 5e-3, ("gemv w8a16", t, M, N, K, rows, rel(y, w16))
        if rows == 128 and K % 128 == 0 and M % 8 == 0 and fk.cublas_supported(x.device):
            y = fk.cublas_block_fp8_gemm(x, wq, fk.cublas_weight_scale(ws), b)
            assert rel(y, ref) < 5e-3, ("cublas", M, N, K, rel(y, ref))
        graph, out = torch.cuda.CUDAGraph(), None
        eager = fk.fp8_linear(x, wq, ws, rows, b)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = fk.fp8_linear(x, wq, ws, rows, b)
        for _ in range(3):              # split K summed by each tile's last program: its counters reset every time
            graph.replay()
            assert torch.equal(out, eager)
        if M <= 64:                     # the ticket sum and the second kernel's give the same bits
            fk.SPLITK_TICKETS = False
            try:
                assert torch.equal(fk.fp8_linear(x, wq, ws, rows, b), eager)
            finally:
                fk.SPLITK_TICKETS = True
            assert not fk._TICKETS[x.device.index].any()


def test_fp8_joined_weight_goes_to_cublas_from_its_rows():
    """A joined FP8 weight (qkv, gate_up: quant.cat_fp8) keeps cuBLAS's scale layout, so from CUBLAS_FROM_M rows
    ops.linear runs it on cuBLAS's block-scaled GEMM as it runs a single weight: the same product as the Triton
    GEMM's, the scales in the joined layout."""
    from specdp_cli.runtime import fp8_kernels as fk, ops
    from specdp_cli.runtime.models.quant import FP8Weight, cat_fp8, quantize_blocks
    dev = torch.device("cuda")
    if not fk.cublas_supported(dev):
        pytest.skip("this torch / GPU has no block-scaled scaled_mm")
    g = torch.Generator(device="cuda").manual_seed(5)
    parts = []
    for n in (512, 128, 256):
        q, s = quantize_blocks(torch.randn(n, 384, device="cuda", generator=g))
        parts.append(FP8Weight(q, s, 128, torch.bfloat16, fk.cublas_weight_scale(s)))
    w = cat_fp8(parts)
    assert w.rows == 128 and w.cublas_scale is not None
    x = torch.randn(fk.CUBLAS_FROM_M + 8, 384, device="cuda", generator=g).bfloat16()
    triton_y = fk.block_fp8_gemm(x, w.weight, w.scale, 128)
    y = ops.linear(x, w)
    assert rel(y, triton_y) < 5e-3, rel(y, triton_y)
    assert rel(y[:, 512:640], ops.linear(x, parts[1])) < 5e-3


@pytest.mark.parametrize("M", [1, 5, 16])
def test_fp8_add_norm_matches_the_norm_kernel(M):
    """o / down joining the residual stream inside the FP8 GEMM and the next FP8 linear applying the RMSNorm's
    1 / rms (ops.linear_add_norm, fp8_kernels' ADD_NORM and RSTD) against the unfused path (the GEMM's output,
    rms_norm with the residual add writing it quantized, the next GEMM) on the 8B's o -> gate_up shapes: the same
    residual to a bf16 rounding, the next linear's output to the norm's rounding; the same numbers with the residual
    and norm weight loaded before the main loop and in the last step (ADD_NORM_EARLY on and off); a CUDA graph's
    replays equal the eager result (split K's counters reset)."""
    from specdp_cli.runtime import ops
    from specdp_cli.runtime import fp8_kernels as fk
    from specdp_cli.runtime.models.quant import FP8Weight, quantize_blocks
    g = torch.Generator(device="cuda").manual_seed(M)
    K, N, N2, eps = 4096, 4096, 2048, 1e-5
    w1 = FP8Weight(*quantize_blocks(torch.randn(N, K, device="cuda", generator=g) / 60), 128, torch.bfloat16)
    w2 = FP8Weight(*quantize_blocks(torch.randn(N2, N, device="cuda", generator=g) / 60), 128, torch.bfloat16)
    norm = (torch.rand(N, device="cuda", generator=g) + 0.5).bfloat16()
    x = fk.FP8Activation(*fk.quantize_activations(torch.randn(M, K, device="cuda", generator=g).bfloat16()),
                         torch.bfloat16)
    residual = (torch.randn(M, N, device="cuda", generator=g) * 3).bfloat16()
    assert ops.add_norm_wanted(x, w1, w2) and not ops.add_norm_wanted(x, w1, None)
    r_plain, r_fused = residual.clone(), residual.clone()
    want = ops.linear(ops.rms_norm(ops.linear(x, w1), norm, eps, r_plain, quantize=True), w2)
    got = ops.linear(ops.linear_add_norm(x, w1, None, r_fused, norm, eps), w2)
    assert rel(r_fused, r_plain) < 1e-2 and rel(got, want) < 2e-2, (rel(r_fused, r_plain), rel(got, want))
    early_was = fk.ADD_NORM_EARLY
    fk.ADD_NORM_EARLY = not early_was          # residual and norm weight loaded in the other place
    try:
        r_other = residual.clone()
        assert torch.equal(ops.linear(ops.linear_add_norm(x, w1, None, r_other, norm, eps), w2), got)
        assert torch.equal(r_other, r_fused)
    finally:
        fk.ADD_NORM_EARLY = early_was
    r, out = residual.clone(), torch.empty_like(got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r.copy_(residual)
        out.copy_(ops.linear(ops.linear_add_norm(x, w1, None, r, norm, eps), w2))
    for _ in range(3):
        out.zero_()
        graph.replay()
        assert torch.equal(out, got) and torch.equal(r, r_fused)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (16, 64, 4), (300, 8, 2)])
def test_fp8_routed_expert_kernels_match_reference(tokens, experts, top_k):
    """The grouped expert kernels reading FP8 experts equal the bf16 kernels on the dequantized experts: weight-only
    (bf16 activations) to bf16 rounding; W8A8 transposed (the tile's W8A8T, the default for 16-row blocks:
    activations quantized per row and 128 columns too) to FP8 activations' error."""
    from specdp_cli.runtime.moe_kernels import routed_experts, tiles
    from specdp_cli.runtime.models.quant import FP8Weight, quantize_blocks
    g = torch.Generator(device="cuda").manual_seed(tokens)
    H, I = 512, 384
    gu_q, gu_s = quantize_blocks(torch.randn(experts, 2 * I, H, device="cuda", generator=g) / 20)
    d_q, d_s = quantize_blocks(torch.randn(experts, H, I, device="cuda", generator=g) / 20)
    gate_up, down = FP8Weight(gu_q, gu_s, 128, torch.bfloat16), FP8Weight(d_q, d_s, 128, torch.bfloat16)
    x = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
    w = torch.rand(tokens, top_k, device="cuda", generator=g)
    idx = torch.stack([torch.randperm(experts, device="cuda", generator=g)[:top_k] for _ in range(tokens)])
    ref = routed_experts(x, w, idx, gate_up.dequantize(torch.bfloat16), down.dequantize(torch.bfloat16))
    t = tiles(tokens * top_k, experts, I, H, torch.bfloat16, fp8=True)
    assert t.get("W8A8T", False) == (tokens * top_k / experts <= 32)        # 16-row blocks
    got = routed_experts(x, w, idx, gate_up, down, tile=dict(t, W8A8T=False))
    assert rel(got, ref) < 1e-2, rel(got, ref)
    got = routed_experts(x, w, idx, gate_up, down)                           # the default tile
    assert rel(got, ref) < (5e-2 if t.get("W8A8T") else 1e-2), rel(got, ref)
    if t.get("W8A8T"):
        for stages in (3, 8):
            got = routed_experts(x, w, idx, gate_up, down, tile=dict(t, stages=stages))
            assert rel(got, ref) < 5e-2, ("w8a8t", stages, rel(got, ref))
        # x quantized before (as the RMSNorm before the experts writes it): bit for bit the tile quantizing x
        # itself, in a graph's replays too
        from specdp_cli.runtime.fp8_kernels import FP8Activation, quantize_activations
        want = routed_experts(x, w, idx, gate_up, down)
        x_q = FP8Activation(*quantize_activations(x), torch.bfloat16)
        run = lambda: routed_experts(x, w, idx, gate_up, down, x_q=x_q)  # noqa: E731
        assert torch.equal(run(), want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        for _ in range(3):
            out.zero_()
            graph.replay()
            assert torch.equal(out, want), "graph"


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_fp8_graphs_equal_eager_bf16(models, tmp_path, family):
    """FP8 kept FP8 on the GPU (bf16 compute): a Llama and a Qwen3-MoE quantized at load (`quantization: fp8`),
    a DeepSeek-V3 FP8 checkpoint in 128 x 128 blocks with its MTP layer (latent attention's reordered rows, the
    shared expert, FP8 routed experts). Greedy tokens with graphs equal eager ones."""
    from helpers import make_deepseek_dir, make_model_dir, make_moe_dir
    from test_fp8 import fp8_pair

    tok = models["tokenizer"]
    method, extra = "draft_model", {"quantization": "fp8"}
    if family == "llama":
        target = make_model_dir(tmp_path / family, tok, layers=2, seed=11)
    elif family == "qwen3_moe":
        target = make_moe_dir(tmp_path / family, tok, "qwen3_moe", seed=4, experts=64, top_k=8, norm_topk_prob=True)
    else:
        src = make_deepseek_dir(tmp_path / "ds", tok, seed=3, experts=8, top_k=2, n_group=2, topk_group=1)
        target, _ = fp8_pair(src, (128, 128))
        method, extra = "mtp", {}
    prompts = prompts_of_lengths([3, 9, 17, 26, 33])
    kw = dict(method=method, k=3, M=64, max_num_seqs=4, max_batched=24, device="cuda", cache=ROOM, dtype="bfloat16")
    out = {}
    for eager in (True, False):
        cfg, plan = make_config(target, models["draft"] if method == "draft_model" else None, enforce_eager=eager,
                                **kw, **extra)
        assert plan.memory["quantization"]["loaded_as"] == "float8_e4m3fn"
        engine = cuda_engine(cfg, plan)
        from specdp_cli.runtime.models.quant import FP8Weight
        assert isinstance(engine.target.model.layers[-1].o, FP8Weight)
        out[eager] = run_engine(engine, prompts, max_tokens=20)
    for i in range(len(prompts)):
        assert out[False][i].generated == out[True][i].generated, i


def test_fp8_moe_norm_quantizes_for_the_experts(models, tmp_path, monkeypatch):
    """A Qwen3-MoE quantized at load whose hidden size is a whole 128-column group: the RMSNorm before the experts
    writes its output plain (for the router) and quantized (for the W8A8 gate/up kernel: moe_kernels.EXPERTS_X_Q).
    Greedy tokens equal those of the experts quantizing x themselves, eager and with graphs (draft_model, k 3:
    decode, verification and prefill rows)."""
    from helpers import make_moe_dir
    from specdp_cli.runtime import moe_kernels as mk

    target = make_moe_dir(tmp_path / "moe", models["tokenizer"], "qwen3_moe", hidden=128, seed=4, experts=64,
                          top_k=8, norm_topk_prob=True)
    prompts = prompts_of_lengths([3, 9, 17, 26, 33])
    kw = dict(method="draft_model", k=3, M=64, max_num_seqs=4, max_batched=24, device="cuda", cache=ROOM,
              dtype="bfloat16", quantization="fp8")
    out = {}
    for x_q in (True, False):
        monkeypatch.setattr(mk, "EXPERTS_X_Q", x_q)
        for eager in (True, False):
            cfg, plan = make_config(target, models["draft"], enforce_eager=eager, **kw)
            engine = cuda_engine(cfg, plan)
            h = torch.zeros(4, 128, device="cuda", dtype=torch.bfloat16)
            assert engine.target.model.layers[0].moe.takes_quantized(h) == x_q
            done = run_engine(engine, prompts, max_tokens=20)
            out[x_q, eager] = [done[i].generated for i in range(len(prompts))]
    assert out[True, True] == out[False, True] == out[True, False] == out[False, False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_norm_and_activation_quantized_for_fp8_equal_quantize_activations(dtype):
    """RMSNorm (with and without the residual add) and silu_and_mul writing their output quantized for an FP8 linear
    (fp8_kernels.FP8Activation) give bit for bit quantize_activations' values and scales of their plain output (the
    GPU's float8 conversion, random inputs), the same residual, and the FP8 GEMM reading them the same product
    (RMSNorm's "both", the plain output too, likewise); decode rows, the 8B's widths and widths that are not a power
    of two; inside a CUDA graph too. Paged attention
    with 128-wide heads (`quantized`) likewise, single pass and keys split."""
    from specdp_cli.runtime import fp8_kernels as fk, ops
    from specdp_cli.runtime.models.quant import FP8Weight, quantize_blocks
    g = torch.Generator(device="cuda").manual_seed(0)
    for M in (1, 7, 64):
        for n in (4096, 384, 1152):
            x = torch.randn(M, n, device="cuda", generator=g).to(dtype)
            w = torch.randn(n, device="cuda", generator=g).to(dtype)
            res = (torch.randn(M, n, device="cuda", generator=g) * 4).to(dtype)
            wq, ws = quantize_blocks(torch.randn(256, n, device="cuda", generator=g))
            weight = FP8Weight(wq, ws, 128, dtype)
            for r in (None, res):
                r_plain, r_fused = (None, None) if r is None else (r.clone(), r.clone())
                plain = ops.rms_norm(x, w, 1e-6, r_plain)
                fused = ops.rms_norm(x, w, 1e-6, r_fused, quantize=True)
                q, s = fk.quantize_activations(plain)
                assert isinstance(fused, fk.FP8Activation) and fused.dtype == dtype
                assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8)), (M, n, r is None)
                assert torch.equal(fused.scale, s), (M, n, r is None)
                if r is not None:
                    assert torch.equal(r_fused, r_plain)
                assert torch.equal(ops.linear(fused, weight), ops.linear(plain, weight))
                r_both = None if r is None else r.clone()
                both = ops.rms_norm(x, w, 1e-6, r_both, quantize="both")      # plain and quantized (MoE's norm)
                assert torch.equal(both.plain, plain) and torch.equal(both.scale, s), (M, n, r is None)
                assert torch.equal(both.q.view(torch.uint8), q.view(torch.uint8)), (M, n, r is None)
                if r is not None:
                    assert torch.equal(r_both, r_plain)
            gu = (torch.randn(M, 2 * n, device="cuda", generator=g) * 3).to(dtype)
            plain = ops.silu_and_mul(gu)
            fused = ops.act_and_mul(gu, "silu", quantize=True)
            q, s = fk.quantize_activations(plain)
            assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(fused.scale, s), (M, n)
            assert torch.equal(ops.linear(fused, weight), ops.linear(plain, weight))
    x, res = x.clone(), res.clone()
    want_res = res.clone()
    want = ops.linear(ops.rms_norm(x, w, 1e-6, want_res), weight)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    r0 = res.clone()
    with torch.cuda.graph(graph):
        out = ops.linear(ops.rms_norm(x, w, 1e-6, res, quantize=True), weight)
    res.copy_(r0)
    graph.replay()
    assert torch.equal(out, want) and torch.equal(res, want_res)
    # paged attention with 128-wide heads writing o's input quantized: one pass, and keys split (the combine kernel
    # writes it)
    from specdp_cli.runtime import triton_kernels as tk
    H, KV, D, BS = 32, 8, 128, 16
    for R, T, S in ((1, 1, 1), (1, 1, None), (2, 5, 1), (2, 5, None)):
        kc = torch.randn(R * 20, BS, KV, D, device="cuda", generator=g).to(dtype)
        vc = (torch.randn(R * 20, BS, KV, D, device="cuda", generator=g) * 3).to(dtype)
        bt = torch.randperm(R * 20, device="cuda", generator=g).view(R, 20).int()
        p = (torch.randint(30, 300, (R, 1), device="cuda", generator=g) + torch.arange(T, device="cuda")).view(-1)
        q = torch.randn(R * T, H, D, device="cuda", generator=g).to(dtype)
        plain = torch.empty(R * T, H, D, device="cuda", dtype=dtype)
        tk.paged_attention(q, kc, vc, plain, p, bt, T, 0.08, None, splits=S)
        values, scales = fk.quantized_rows(R * T, H * D, q.device)
        tk.paged_attention(q, kc, vc, plain[:1], p, bt, T, 0.08, None, splits=S, quantized=(values, scales))
        want_q, want_s = fk.quantize_activations(plain.view(R * T, H * D))
        assert torch.equal(values.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_s), (R, T, S)


def test_fp8_fused_decode_quantization_equals_unfused_in_graphs(models, tmp_path, monkeypatch):
    """A Llama quantized at load (`quantization: fp8`, bf16, hidden 256: whole 128-column groups; heads 128 wide) in
    CUDA graphs: its norms, silu_and_mul and attention hand the FP8 linears their outputs quantized
    (fp8_kernels.FUSE_DECODE_QUANT) or not; greedy tokens are identical either way, and equal eager execution's with
    it."""
    from helpers import make_model_dir
    from specdp_cli.runtime import fp8_kernels as fk
    from specdp_cli.runtime.models.quant import FP8Weight

    target = make_model_dir(tmp_path / "llama", models["tokenizer"], hidden=256, layers=2, heads=2, kv_heads=1,
                            seed=11)
    decided = []
    wanted = fk.fused_quant_wanted
    monkeypatch.setattr(fk, "fused_quant_wanted", lambda x, w: decided.append(wanted(x, w)) or decided[-1])
    prompts = prompts_of_lengths([3, 9, 17, 26, 33])
    kw = dict(method="draft_model", k=3, M=64, max_num_seqs=4, max_batched=24, device="cuda", cache=ROOM,
              dtype="bfloat16", quantization="fp8")
    out = {}
    monkeypatch.setattr(fk, "FUSE_ATTENTION_QUANT", True)        # the attention's too (the default)
    for fuse, eager in ((True, False), (False, False), (True, True)):
        monkeypatch.setattr(fk, "FUSE_DECODE_QUANT", fuse)
        decided.clear()
        cfg, plan = make_config(target, models["draft"], enforce_eager=eager, **kw)
        engine = cuda_engine(cfg, plan)
        assert isinstance(engine.target.model.layers[0].gate_up, FP8Weight)
        out[fuse, eager] = run_engine(engine, prompts, max_tokens=20)
        assert any(decided) == fuse and (engine.graphs == 0) == eager, (fuse, eager, engine.graphs)
        del engine
    for i in range(len(prompts)):
        assert out[True, False][i].generated == out[False, False][i].generated == out[True, True][i].generated, i


def test_request_fields_and_prefix_cache_graphs_equal_eager_float32(models):
    """What a request asks of the distribution (penalties, bias, min_tokens, a grammar, log-probabilities) and
    prefix caching on CUDA: a step that asks runs its forwards' graphs one by one and adjusts the verified
    logits eagerly; greedy float32 tokens equal eager execution's and plain decoding's, and log-probabilities
    agree."""
    from pathlib import Path

    from specdp_cli.request_params import check_sampling

    demo = Path(__file__).resolve().parent.parent / "demo" / "pair"
    grammar = check_sampling({"structured_outputs": {"regex": r"(def|class) [a-z_]{1,10}\([a-z]{0,6}\):"}},
                             {})["structured_outputs"]
    asks = [dict(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={7: 3.0}, min_tokens=8, logprobs=2),
            dict(structured_outputs=grammar)]
    out = {}
    for eager in (True, False):
        cfg, plan = make_config(demo / "target", demo / "draft", k=4, M=256, max_num_seqs=4, max_batched=256,
                                device="cuda", cache={**ROOM, "block_size": 16}, enforce_eager=eager)
        engine = cuda_engine(cfg, plan)
        tok = engine.output.tokenizer
        shared = tok.encode("import os\nimport sys\nimport json\n" * 6)
        prompts = [shared + tok.encode(t) for t in ("def add(a, b):\n", "class Point:\n", "for i in x:\n")]
        for j, kw in enumerate(asks):
            spec = run_engine(engine, prompts, max_tokens=24, **kw)
            plain = run_engine(engine, prompts, max_tokens=24, speculative=False, **kw)
            assert [spec[i].generated for i in range(3)] == [plain[i].generated for i in range(3)], (eager, j)
            out[eager, j] = [spec[i] for i in range(3)]
        assert engine.pool.hits > 0 and (engine.graphs == 0) == eager
    for j in range(len(asks)):
        assert [s.generated for s in out[True, j]] == [s.generated for s in out[False, j]]
    for a, b in zip(out[True, 0], out[False, 0]):
        assert max(abs(x[0] - y[0]) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def _decoder_chain(x, res, norm_w, gate_up, down, qkv, layers: int, fp8_kernels, triton_kernels):
    """A decode step's kernel chain (norm -> projection -> attention-like reads -> norm with residual -> gate_up ->
    silu_and_mul -> down), FP8 activations handed on where the engine hands them, `layers` times."""
    tk, fk = triton_kernels, fp8_kernels
    outs = []
    for _ in range(layers):
        h = tk.rms_norm(x, norm_w, 1e-6, quantize=True)
        q = fk.fp8_linear(h, *qkv)
        x = q[:, : x.shape[1]].contiguous()
        h = tk.rms_norm(x, norm_w, 1e-6, residual=res, quantize=True)
        a = tk.silu_and_mul(fk.fp8_linear(h, *gate_up), quantize=True)
        x = fk.fp8_linear(a, *down)
        outs.append(x)
    return torch.stack(outs), res


def test_pdl_chain_and_engines_equal_plain_launches(models, tmp_path, monkeypatch):
    """Programmatic dependent launch (runtime/pdl.py: each kernel lets the next launch early, waits for the one before
    it; GEMMs launched plainly (the default) or with PDL, letting the next kernel launch at their start or after
    their loop and prefetching their weights into L2 before the wait) changes no bit: a chain of norms, FP8 GEMMs
    (split K with ticket sums, prefetch trimmed to the budget) and silu_and_mul in a CUDA graph over 20 replays
    equals the same chain launched plainly; then a Llama (bf16 and FP8) and a Qwen3-MoE (FP8) in graphs give the same
    greedy tokens with PDL on and off."""
    from helpers import make_model_dir, make_moe_dir
    from specdp_cli.runtime import fp8_kernels as fk
    from specdp_cli.runtime import pdl
    from specdp_cli.runtime import triton_kernels as tk
    from specdp_cli.runtime.models.quant import quantize_blocks

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    assert pdl.enabled(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(5)
    H, I = 1024, 4096

    def weight(n, k):
        wq, ws = quantize_blocks(torch.randn(n, k, device="cuda", generator=g) / 30)
        return wq, ws, 128

    qkv, gate_up, down = weight(2 * H, H), weight(2 * I, H), weight(H, I)
    norm_w = torch.rand(H, device="cuda", generator=g).bfloat16() + 0.5
    assert fk.prefetch_bytes(2 * I // 32, 32, H) > 0
    for M, trigger in ((1, "off"), (1, "start"), (16, "end"), (16, "off")):
        x0 = torch.randn(M, H, device="cuda", generator=g).bfloat16()
        r0 = torch.randn(M, H, device="cuda", generator=g).bfloat16()
        monkeypatch.setattr(pdl, "ENABLED", False)
        want, want_res = _decoder_chain(x0.clone(), r0.clone(), norm_w, gate_up, down, qkv, 6, fk, tk)
        monkeypatch.setattr(pdl, "ENABLED", True)
        monkeypatch.setattr(pdl, "GEMM_TRIGGER", trigger)
        x, res = x0.clone(), r0.clone()
        _decoder_chain(x, res.clone(), norm_w, gate_up, down, qkv, 6, fk, tk)        # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, out_res = _decoder_chain(x, res, norm_w, gate_up, down, qkv, 6, fk, tk)
        for _ in range(20):
            res.copy_(r0)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want) and torch.equal(out_res, want_res), (M, trigger)
    monkeypatch.setattr(pdl, "GEMM_TRIGGER", "off")

    tok = models["tokenizer"]
    llama = make_model_dir(tmp_path / "llama", tok, hidden=256, layers=2, heads=4, kv_heads=2, seed=11)
    moe = make_moe_dir(tmp_path / "moe", tok, "qwen3_moe", seed=4, experts=64, top_k=8, norm_topk_prob=True)
    prompts = prompts_of_lengths([3, 9, 17, 26, 33])
    for target, quant in ((llama, None), (llama, "fp8"), (moe, "fp8")):
        out = {}
        for on in (True, False):
            monkeypatch.setattr(pdl, "ENABLED", on)
            extra = {"quantization": quant} if quant else {}
            cfg, plan = make_config(target, models["draft"], method="draft_model", k=3, M=64, max_num_seqs=4,
                                    max_batched=24, device="cuda", cache=ROOM, dtype="bfloat16", **extra)
            engine = cuda_engine(cfg, plan)
            assert engine.graphs > 0
            out[on] = run_engine(engine, prompts, max_tokens=20)
            del engine
        for i in range(len(prompts)):
            assert out[True][i].generated == out[False][i].generated, (target.name, quant, i)
