"""Tiny model directories built by the tests themselves (random weights, a small BPE tokenizer)."""
from __future__ import annotations

import http.server
import json
import os
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
DEMO_PAIR = REPO / "demo" / "pair"

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main(sys.argv)\n",
    "while True:\n    line = input()\n    if not line:\n        break\n",
    "The quick brown fox jumps over the lazy dog. 0123456789 {}[]()<>!?;:'\"",
]


def build_tokenizer(path: Path, vocab_size: int = 320, extra: str = ""):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((CORPUS + [extra]) * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|pad|>", unk_token=None)
    fast.save_pretrained(str(path))
    return fast


def make_model_dir(path: Path, tokenizer_dir: Path | None = None, family: str = "llama", hidden: int = 64,
                   layers: int = 2, heads: int = 4, kv_heads: int = 2, max_pos: int = 512, vocab: int | None = None,
                   seed: int = 0, peaked: float = 3.0, eos: int | None = None, copy_of: Path | None = None,
                   **config_extra) -> Path:
    """A random causal LM saved as a Hugging Face directory, with the tokenizer copied in.

    `peaked` scales the output embedding so logits are far apart: float32 rounding then never
    flips an argmax between differently-shaped (but equal) computations."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir else None
    V = vocab or (len(tok) if tok is not None else 320)
    torch.manual_seed(seed)
    if copy_of is not None:
        model = LlamaForCausalLM.from_pretrained(str(copy_of)) if family == "llama" else Qwen2ForCausalLM.from_pretrained(str(copy_of))
    else:
        cls, cfg_cls = (LlamaForCausalLM, LlamaConfig) if family == "llama" else (Qwen2ForCausalLM, Qwen2Config)
        cfg = cfg_cls(vocab_size=V, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=hidden * 2, max_position_embeddings=max_pos,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=eos if eos is not None else 0,
                      pad_token_id=1, **config_extra)
        model = cls(cfg)
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0, peaked / hidden ** 0.5)
            model.get_input_embeddings().weight.normal_(0, 1.0)
    model.save_pretrained(str(path))
    if tok is not None:
        tok.save_pretrained(str(path))
    return path


def write_config(path: Path, data: dict) -> Path:
    path = Path(path)
    if path.suffix == ".toml":
        path.write_text(_to_toml(data))
    else:
        path.write_text(yaml.safe_dump(data))
    return path


def _to_toml(data: dict, prefix: str = "") -> str:
    scalars, tables = [], []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            scalars.append(f"{k} = {json.dumps(v)}")
    out = "\n".join(scalars) + "\n"
    for k, v in tables:
        name = f"{prefix}{k}"
        out += f"\n[{name}]\n" + _to_toml(v, prefix=name + ".")
    return out


def set_config_json(model_dir: Path, **updates) -> None:
    p = Path(model_dir) / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(updates)
    p.write_text(json.dumps(cfg))


def set_eos(model_dir: Path, eos: int) -> None:
    """Make `eos` the model's end-of-sequence token (config and generation config)."""
    set_config_json(model_dir, eos_token_id=eos)
    gen = Path(model_dir) / "generation_config.json"
    g = json.loads(gen.read_text()) if gen.exists() else {}
    g["eos_token_id"] = eos
    gen.write_text(json.dumps(g))


def cpu_threads() -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_eagle_head(path: Path, target_dir: Path, seed: int = 3, perfect: bool = False) -> Path:
    """An EAGLE-1 head directory for `target_dir` (the published layout: fc, layers.0.* without an
    input norm, a Llama config.json; bf16 tensors under a config that says float32, as the shipped
    head has). Random weights, or with `perfect` a head that predicts a `bigram_target` exactly: it
    passes the next token's embedding through (fc = [I / sqrt(1 + eps) | 0]) and its attention and
    MLP add nothing, so its feature is the target's next hidden state."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    h, heads, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps = h // heads, cfg["rms_norm_eps"]
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    w = {"fc.weight": r(h, 2 * h), "fc.bias": r(h),
         "layers.0.self_attn.q_proj.weight": r(heads * hd, h), "layers.0.self_attn.k_proj.weight": r(kvh * hd, h),
         "layers.0.self_attn.v_proj.weight": r(kvh * hd, h), "layers.0.self_attn.o_proj.weight": r(h, heads * hd),
         "layers.0.mlp.gate_proj.weight": r(2 * h, h), "layers.0.mlp.up_proj.weight": r(2 * h, h),
         "layers.0.mlp.down_proj.weight": r(h, 2 * h), "layers.0.post_attention_layernorm.weight": 1 + r(h)}
    if perfect:
        w["fc.weight"] = torch.cat([torch.eye(h) / (1 + eps) ** 0.5, torch.zeros(h, h)], 1)
        w["fc.bias"] = torch.zeros(h)
        w["layers.0.self_attn.o_proj.weight"] = torch.zeros(h, heads * hd)
        w["layers.0.mlp.down_proj.weight"] = torch.zeros(h, 2 * h)
    dtype = torch.float32 if perfect else torch.bfloat16
    save_file({k: v.to(dtype).contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    head_cfg = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                    "max_position_embeddings", "vocab_size")}
    head_cfg.update(architectures=["EagleLlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                    intermediate_size=2 * h, dtype="float32")
    (path / "config.json").write_text(json.dumps(head_cfg))
    return path


def bigram_target(path: Path, tokenizer_dir: Path, seed: int = 1) -> Path:
    """A target whose next token depends on the current token alone: attention and MLP outputs are
    zero and every embedding row has RMS 1, so its last hidden state is its token's embedding
    (after the final norm) — what `make_eagle_head(perfect=True)` predicts."""
    from safetensors.torch import load_file, save_file

    path = make_model_dir(path, tokenizer_dir, layers=2, seed=seed)
    f = next(Path(path).glob("*.safetensors"))
    sd = load_file(str(f))
    for k in list(sd):
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            sd[k] = torch.zeros_like(sd[k])
    e = sd["model.embed_tokens.weight"]
    sd["model.embed_tokens.weight"] = e / e.pow(2).mean(-1, keepdim=True).sqrt()
    save_file(sd, str(f), metadata={"format": "pt"})
    return path


def make_eagle3_head(path: Path, target_dir: Path, aux_ids: list[int] | None = (0, 1, 2), draft_vocab: int | None = None,
                     own_embedding: bool = False, seed: int = 4) -> Path:
    """A random EAGLE-3 head directory for `target_dir` in the layout vLLM's llama_eagle3 reads: fc [h, 3h]
    over three target layers' streams, midlayer.* (q/k/v over 2h inputs, input_layernorm, hidden_norm,
    post_attention_layernorm, mlp), norm, lm_head over a draft vocabulary of `draft_vocab` ids (every
    other target id, mapped back by d2t) or the full one (no d2t)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    h, heads, kvh, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    hd = h // heads
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    n_aux = len(aux_ids) if aux_ids else 3
    dv = draft_vocab or V
    p = "midlayer."
    w = {"fc.weight": r(h, n_aux * h), p + "self_attn.q_proj.weight": r(heads * hd, 2 * h),
         p + "self_attn.k_proj.weight": r(kvh * hd, 2 * h), p + "self_attn.v_proj.weight": r(kvh * hd, 2 * h),
         p + "self_attn.o_proj.weight": r(h, heads * hd), p + "mlp.gate_proj.weight": r(2 * h, h),
         p + "mlp.up_proj.weight": r(2 * h, h), p + "mlp.down_proj.weight": r(h, 2 * h),
         p + "input_layernorm.weight": 1 + r(h), p + "hidden_norm.weight": 1 + r(h),
         p + "post_attention_layernorm.weight": 1 + r(h), "norm.weight": 1 + r(h), "lm_head.weight": r(dv, h, scale=1.0)}
    if draft_vocab:
        ids = torch.arange(0, 2 * dv, 2)[:dv].clamp(max=V - 1)
        w["d2t"] = ids - torch.arange(dv)
    if own_embedding:
        w["embed_tokens.weight"] = r(V, h, scale=1.0)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    head_cfg = {k: cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                    "max_position_embeddings", "vocab_size")}
    head_cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                    intermediate_size=2 * h, draft_vocab_size=dv)
    if aux_ids:
        head_cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    (path / "config.json").write_text(json.dumps(head_cfg))
    return path


def make_moe_dir(path: Path, tokenizer_dir: Path, family: str = "mixtral", hidden: int = 64, layers: int = 2,
                 experts: int = 4, top_k: int = 2, seed: int = 0, peaked: float = 3.0, **config_extra) -> Path:
    """A random mixture-of-experts causal LM (Mixtral or Qwen3-MoE) saved as a Hugging Face directory,
    with the tokenizer copied in; `peaked` as in make_model_dir."""
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    kw = dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=hidden * 2, max_position_embeddings=512,
              tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=1, num_experts_per_tok=top_k)
    torch.manual_seed(seed)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=experts, **kw, **config_extra))
    else:
        config_extra.setdefault("moe_intermediate_size", hidden)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=experts, head_dim=16, **kw, **config_extra))
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, peaked / hidden ** 0.5)
        model.get_input_embeddings().weight.normal_(0, 1.0)
        for name, p in model.named_parameters():
            if "gate" in name and p.dim() == 2 and p.shape[0] == experts:
                p.normal_(0, 1.0)              # a router that prefers different experts for different tokens
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def make_deepseek_dir(path: Path, tokenizer_dir: Path, q_lora_rank: int | None = 32, rope_interleave: bool = True,
                      seed: int = 0, peaked: float = 3.0, mtp_layer: bool = True, bigram: bool = False,
                      experts: int = 4, top_k: int = 2, n_group: int = 2, topk_group: int = 1,
                      **config_extra) -> Path:
    """A random DeepSeek-V3 saved as a Hugging Face directory, with the tokenizer copied in: 3 layers (the
    first dense), latent attention (4 heads, key [16 nope | 8 rope], value 16, kv_lora 32, q_lora
    `q_lora_rank`), `experts` routed experts in `n_group` groups (the top `top_k` from the best `topk_group`
    groups; by default 4 in 2, top 2 from the best one) and one shared expert. The
    router (std 1) and a non-zero e_score_correction_bias make routing vary by token; weights of std 0.1
    make attention position-dependent. With `mtp_layer` the checkpoint holds a multi-token-prediction layer
    as DeepSeek-V3's do: model.layers.3.* (a fourth decoder layer, sparse) with enorm, hnorm, eh_proj [64, 128]
    and shared_head.{norm, head}; config.json says num_hidden_layers 3, num_nextn_predict_layers 1.
    With `bigram` the attention and MLP outputs are zero and every embedding row has RMS 1 (the next token
    depends on the current one alone, as in `bigram_target`), and the MTP layer predicts it exactly: eh_proj
    passes the next token's normed embedding through and its shared head is the target's norm and LM head.
    `peaked` as in make_model_dir."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    hidden, N = 64, 3
    cfg = DeepseekV3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=32,
                           num_hidden_layers=N + int(mtp_layer), num_attention_heads=4, num_key_value_heads=4,
                           n_shared_experts=1, n_routed_experts=experts, num_experts_per_tok=top_k, n_group=n_group,
                           topk_group=topk_group,
                           first_k_dense_replace=1, q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16,
                           qk_rope_head_dim=8, v_head_dim=16, rope_interleave=rope_interleave,
                           max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
                           bos_token_id=0, eos_token_id=0, pad_token_id=1, num_nextn_predict_layers=1, **config_extra)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, peaked / hidden ** 0.5)
        model.get_input_embeddings().weight.normal_(0, 1.0)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    if not (mtp_layer or bigram):
        return path
    # the decoder layer past num_hidden_layers becomes the MTP layer's: config.json no longer counts it
    set_config_json(path, num_hidden_layers=N)
    f = next(path.glob("*.safetensors"))
    sd = load_file(str(f))
    if bigram:
        for k in sd:
            if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
                sd[k] = torch.zeros_like(sd[k])
        e = sd["model.embed_tokens.weight"]
        sd["model.embed_tokens.weight"] = e / e.pow(2).mean(-1, keepdim=True).sqrt()
    if mtp_layer:
        g = torch.Generator().manual_seed(seed + 1)
        mtp, head_std = f"model.layers.{N}.", peaked / hidden ** 0.5
        sd.update({mtp + "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
                   mtp + "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
                   mtp + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
                   mtp + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
                   mtp + "shared_head.head.weight": torch.randn(len(tok), hidden, generator=g) * head_std})
        if bigram:
            eps = cfg.rms_norm_eps
            sd[mtp + "enorm.weight"] = torch.ones(hidden)
            # [I | 0] (times sqrt(1 + eps), undoing enorm's eps): the output is the next token's embedding
            sd[mtp + "eh_proj.weight"] = torch.cat([torch.eye(hidden) * (1 + eps) ** 0.5,
                                                    torch.zeros(hidden, hidden)], 1)
            sd[mtp + "shared_head.norm.weight"] = sd["model.norm.weight"].clone()
            sd[mtp + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, str(f), metadata={"format": "pt"})
    return path


class ModelListing(http.server.BaseHTTPRequestHandler):
    """A stand-in OpenAI-compatible server's GET side: /v1/models lists one model ("m"), anything else is a 404;
    quiet. Subclasses answer the completions (do_POST)."""

    def do_GET(self):
        body = json.dumps({"data": [{"id": "m"}]}).encode() if self.path == "/v1/models" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass
