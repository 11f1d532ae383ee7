"""method: eagle3 (EAGLE-3 heads, the layout vLLM's llama_eagle3 reads): the target's aux hidden states
are the streams entering the chosen layers (as transformers' hidden_states number them), the head
computes what that layout defines (a plain reference here), greedy float32 output equals target-only
output token for token with a draft vocabulary mapped by d2t, and preflight checks the layer ids."""
import json

import pytest
import torch
import torch.nn.functional as F

from dp_util import HARD_TIMEOUT_S, dp_config, generate_args, lockstep_run_equals_dp1, selected, text_rows, write_jsonl
from engine_util import check_against_reference, make_config, make_engine, prompts_of_lengths, run_engine
from helpers import make_eagle3_head

LENGTHS = [3, 9, 17, 26, 33, 41, 50, 57, 62]


@pytest.fixture(scope="module")
def heads(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("eagle3")
    return {"small_vocab": make_eagle3_head(root / "small", models["target"], aux_ids=[0, 1, 2], draft_vocab=96),
            "full_vocab": make_eagle3_head(root / "full", models["target"], aux_ids=[1, 0, 1], own_embedding=True,
                                           seed=9),
            "default_ids": make_eagle3_head(root / "default", models["target"], aux_ids=None)}


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_head(head_dir, embed, feats, ids, cfg):
    """The EAGLE-3 midlayer written out plainly (vLLM's llama_eagle3 semantics)."""
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, LlamaRotaryEmbedding
    from transformers import LlamaConfig

    w = {k: v.float() for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    p, eps = "midlayer.", cfg["rms_norm_eps"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    N, h = feats.shape
    D = h // H
    emb = w.get("embed_tokens.weight", embed)
    x = torch.cat([rms(F.embedding(ids, emb), w[p + "input_layernorm.weight"], eps),
                   rms(feats, w[p + "hidden_norm.weight"], eps)], -1)
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(N, H, D).transpose(0, 1)[None]
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(N, KV, D).transpose(0, 1)[None]
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(N, KV, D).transpose(0, 1)[None]
    lc = LlamaConfig(**{kk: vv for kk, vv in cfg.items() if kk not in ("architectures", "model_type")})
    cos, sin = LlamaRotaryEmbedding(lc)(x[None], torch.arange(N)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    att = (q @ k.transpose(-1, -2)) / D ** 0.5 + torch.full((N, N), float("-inf")).triu(1)
    o = (att.softmax(-1) @ v)[0].transpose(0, 1).reshape(N, H * D) @ w[p + "self_attn.o_proj.weight"].T
    r = feats + o
    hh = rms(r, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = hh @ w[p + "mlp.gate_proj.weight"].T, hh @ w[p + "mlp.up_proj.weight"].T
    r = r + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    draft = rms(r, w["norm.weight"], eps) @ w["lm_head.weight"].T
    if "d2t" not in w:
        return r, draft
    full = torch.full((N, embed.shape[0]), float("-inf"))
    full[:, torch.arange(draft.shape[1]) + w["d2t"].long()] = draft
    return r, full


@pytest.mark.parametrize("which", ["small_vocab", "full_vocab"])
def test_aux_states_and_head_equal_the_reference(models, heads, which):
    from transformers import LlamaForCausalLM

    from specdp_cli.runtime.models.eagle import load_eagle3_head
    from specdp_cli.runtime.kv_cache import allocate_kv
    from specdp_cli.runtime.models.loader import load_model
    from specdp_cli.runtime.model_runner import ModelRunner

    head_dir = heads[which]
    cfg = json.loads((head_dir / "config.json").read_text())
    cpu, N, bs = torch.device("cpu"), 19, 4
    target = load_model(str(models["target"]), torch.float32, cpu, 64)
    head = load_eagle3_head(str(head_dir), target, torch.float32, cpu, 64)
    table = torch.zeros((1, 8), dtype=torch.int32)
    table[0, :5] = torch.arange(1, 6)
    for m in (target, head):
        allocate_kv(m, 8, bs)
    t_run = ModelRunner(target, cpu, table, bs, 1, [N], window=N)
    h_run = ModelRunner(head, cpu, table, bs, 1, [N], window=N, keep_hidden="window")
    head.attach(t_run)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, target.vocab_size, (N + 1,), generator=g)
    zero, full = torch.zeros(1, dtype=torch.long), torch.full((1,), N)
    t_run.set_rows(1, ids[:N].view(1, N), zero, full, zero)
    t_run.forward(1, N, graphs=False)

    hf = LlamaForCausalLM.from_pretrained(str(models["target"]), dtype=torch.float32).eval()
    before_norm = []               # transformers' last hidden_states entry is after the final norm: id N is before it
    hf.model.norm.register_forward_hook(lambda _m, args, _out: before_norm.append(args[0]))
    with torch.no_grad():
        hs = hf(ids[None, :N], output_hidden_states=True).hidden_states
    n = len(hs) - 1
    ref_aux = torch.cat([(before_norm[0] if j == n else hs[j])[0] for j in cfg["eagle_aux_hidden_state_layer_ids"]], -1)
    torch.testing.assert_close(target.aux_buf[:N], ref_aux, rtol=1e-4, atol=1e-5)

    head.prepare_features(N)
    h_run.set_rows(1, ids[1:].view(1, N), zero, full, zero)
    logits = h_run.forward(1, N, graphs=False)[0]
    feats = ref_aux @ load_head_fc(head_dir).T
    ref_stream, ref_logits = reference_head(head_dir, target.embed, feats, ids[1:], cfg)
    torch.testing.assert_close(h_run.hidden[:N], ref_stream, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    if which == "small_vocab":          # drafts only ever name ids of the draft vocabulary, as target ids
        assert set(logits.argmax(-1).tolist()) <= set(range(0, 192, 2))


def load_head_fc(head_dir):
    from safetensors.torch import load_file
    return load_file(str(head_dir / "model.safetensors"))["fc.weight"].float()


@pytest.mark.parametrize("which", ["small_vocab", "full_vocab"])
def test_greedy_equals_target_only(models, heads, which):
    M = 64
    cfg, plan = make_config(models["target"], heads[which], method="eagle3", k=3, M=M, D=48, max_num_seqs=4,
                            max_batched=24)
    engine = make_engine(cfg, plan)
    prompts = prompts_of_lengths(LENGTHS, seed=4)
    done = run_engine(engine, prompts, max_tokens=30)
    check_against_reference(models["target"], done, prompts, 30, M)
    assert engine.counters.spec.num_drafts > 0


def test_preflight_checks_the_target_layers(models, heads):
    from specdp_cli.config import validate
    from specdp_cli.preflight import run_preflight

    def report(head, method="eagle3"):
        return run_preflight(validate({"model": str(models["target"]), "max_model_len": 64, "device": "cpu",
                                       "speculative": {"method": method, "model": str(head)}}))

    ok = report(heads["small_vocab"])
    assert ok.ok, ok.errors
    files = next(c for c in ok.checks if c.name == "files").detail
    assert "EAGLE-3 layout, target layers [0, 1, 2], draft vocabulary 96" in files
    # vLLM's default (2, N // 2, N - 3) does not fit a 2-layer target
    assert any("reads target layers [2, 1, -1] but the target has 2" in e for e in report(heads["default_ids"]).errors)
    assert any("use speculative.method: eagle3" in e for e in report(heads["small_vocab"], "eagle").errors)


@pytest.fixture(scope="module", autouse=True)
def eagle3_job(request, tmp_path_factory, models, heads, launches) -> dict:
    """The lockstep test's command, started when this module starts, while the in-process tests run."""
    if not selected(request, "test_lockstep_dp3_equals_dp1"):
        return {}
    tmp = tmp_path_factory.mktemp("eagle3_job")
    rows = text_rows(models["tokenizer"], [30, 4, 7, 10, 13], [30, 2, 9, 16, 5], seed=23)
    inp = write_jsonl(tmp / "in.jsonl", rows)
    cfg = dp_config(tmp, models["target"], heads["small_vocab"], dp=3, dp_sync="always", method="eagle3", k=3,
                    M=64, D=40, check=True)
    launches.start("lockstep", *generate_args(tmp, inp, cfg))
    return {"tmp": tmp, "inp": inp, "cfg": cfg}


@pytest.mark.timeout(HARD_TIMEOUT_S * 2)
def test_lockstep_dp3_equals_dp1(eagle3_job, launches):
    ranks = lockstep_run_equals_dp1(eagle3_job["tmp"], eagle3_job["inp"], eagle3_job["cfg"],
                                    launched=lambda: launches.result("lockstep"))
    assert len(ranks) == 3 and len({x["steps"] for x in ranks}) == 1
