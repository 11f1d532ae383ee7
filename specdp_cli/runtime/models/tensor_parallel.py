"""Tensor parallelism of the dense decoder (Megatron's split): which part of each weight a process holds.

Column-parallel (a slice of the output rows): q_proj by query heads, k_proj / v_proj by KV heads, gate_proj /
up_proj by intermediate columns, with their biases. Row-parallel (a slice of the input columns): o_proj and
down_proj; their products are partial sums that the decoder all-reduces over the TP group before adding the
(whole) bias. Norms and per-head q/k norms are held whole.

Vocab-parallel embedding and LM head (Megatron's / vLLM's VocabParallelEmbedding): process t holds rows
[t * P, (t + 1) * P) of the embedding and of the LM head, P = ceil(vocab_size / tp) (the last process's rows past
vocab_size are zero padding); a lookup reads zeros for ids outside its rows and one all-reduce sums the parts, the
LM head computes its slice of the logits and one all-gather joins them (models/decoder.py). A tied LM head is the
same slice. DeepSeek-V3's MTP layer splits its own `embed_tokens` / `shared_head.head` the same way.

KV heads: split when tp divides them; when tp exceeds them (tp a multiple of their number) each process holds the
one KV head its query heads read, so a KV head is replicated tp / KV times.

Mixture of experts (Qwen3-MoE, Mixtral): every routed expert is split as a dense MLP is, along its own intermediate
dimension (moe_intermediate_size; Mixtral's experts: intermediate_size): gate / up (w1 / w3) column-parallel, down
(w2) row-parallel. The router is held whole, so every process routes every token alike; the MoE layer all-reduces
its partial sums over the TP group (models/moe.py). DeepSeek-V3's shared experts (n_shared_experts x
moe_intermediate_size columns) split as a dense MLP; their partial sums join the routed experts' before the one
all-reduce.

Latent attention (DeepSeek-V3) splits by heads: the query's last projection (q_b_proj, or q_proj without a query
LoRA rank; a head's nope + rope rows) and kv_b_proj (a head's nope key + value rows) column-parallel, o_proj
row-parallel (a head's v_head_dim columns); q_a_proj, kv_a_proj_with_mqa and their norms — the low-rank latents
every head reads — are held whole. specdp caches each head's expanded key and value, so the KV cache splits with
the heads.

Block-FP8 checkpoints (models/quant.py): a weight [N, K] with one scale per bm x bn block is split with its scales,
by output rows (column-parallel: the scales' rows N / bm) or input columns (row-parallel: the scales' columns
K / bn). Every split must fall on a block boundary (`fp8_refusal`), so that each process holds whole blocks —
exactly the blocks of the unsplit checkpoint. (`quantization: fp8` quantizes each process's slice as it loads.)

A draft model split over the TP group (`speculative.draft_tensor_parallel_size` = tensor_parallel_size) is split
exactly as a target of its family: the same `shard_of`, `Shard.cut` and `refusal`.

What the engine checks before loading (preflight: `refusal`, `fp8_refusal`), and what it loads (`Shard.cut`, read
straight from the safetensors file: a process never holds another's slice).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .naming import layer_index
from .quant import QuantizationError, quantization_of

COLUMN = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv", "mlp.gate_proj": "inter",
          "mlp.up_proj": "inter", "self_attn.q_b_proj": "q", "self_attn.kv_b_proj": "kv_b",
          "mlp.shared_experts.gate_proj": "shared", "mlp.shared_experts.up_proj": "shared"}
ROW = {"self_attn.o_proj": "o", "mlp.down_proj": "inter", "mlp.shared_experts.down_proj": "shared"}
# a routed expert's projections (per-expert checkpoints: `….experts.{e}.gate_proj.weight`), by their kind
_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3|down_proj|w2)\.weight$")
EXPERT_ROW = ("down_proj", "w2")
_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")    # every expert in one tensor (transformers 5)
EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")    # the routed experts of the families split here
# split by vocabulary rows: the embedding, the LM head, DeepSeek-V3's MTP layer's own (model.layers.{N}.…)
_VOCAB = re.compile(r"(?:^|\.)(?:embed_tokens|lm_head|shared_head\.head)\.weight$")


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    heads: int               # the model's query heads
    kv_heads: int
    head_dim: int
    intermediate: int
    expert_intermediate: int = 0     # a routed expert's intermediate size (0: no experts)
    shared_intermediate: int = 0     # the shared experts' intermediate size (DeepSeek; 0: none)
    latent: tuple[int, int, int] | None = None    # latent attention's per-head (nope, rope, value) widths
    vocab: int = 0                   # the vocabulary (vocab_size; 0: embedding and LM head held whole)
    block: tuple[int, int] | None = None     # a block-FP8 checkpoint's weight_block_size (its scales cut with it)

    @property
    def vocab_rows(self) -> int:
        """The embedding / LM head rows every process holds (the vocabulary padded to a multiple of tp, over tp)."""
        return -(-self.vocab // self.size)

    @property
    def vocab_first(self) -> int:
        return self.rank * self.vocab_rows

    @staticmethod
    def is_vocab(name: str) -> bool:
        return _VOCAB.search(name) is not None

    def vocab_mismatch(self, name: str, rows: int) -> str | None:
        """Why vocab-split tensor `name` of `rows` rows cannot be split as config.json's vocab_size says (None: it
        can, or it is not split by vocabulary)."""
        if not self.vocab or not self.is_vocab(name) or rows == self.vocab:
            return None
        return (f"{name} has {rows} rows but config.json's vocab_size is {self.vocab}: tensor parallelism splits "
                f"the embedding and LM head by vocab_size (set tensor_parallel_size: 1, or correct vocab_size)")

    @property
    def local_heads(self) -> int:
        return self.heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.kv_heads // self.size)

    def _per_head(self, kind: str) -> int:
        """The rows (columns) one head owns in a `kind` dimension."""
        if self.latent is None:
            return self.head_dim
        nope, rope, v = self.latent
        return {"q": nope + rope, "kv_b": nope + v, "o": v}[kind]

    def _range(self, kind: str) -> tuple[int, int]:
        """[first, end) of this process's rows (column-parallel) or columns (row-parallel) of a `kind` dimension."""
        D = self.head_dim
        if kind in ("q", "kv_b", "o"):
            n = self.local_heads * self._per_head(kind)
            return self.rank * n, (self.rank + 1) * n
        if kind == "vocab":                        # the padding rows past the vocabulary are not read
            return min(self.vocab_first, self.vocab), min(self.vocab_first + self.vocab_rows, self.vocab)
        if kind == "kv":
            if self.size <= self.kv_heads:
                first = self.rank * self.local_kv_heads
            else:                                  # replicated: the KV head of this process's query heads
                first = self.rank * self.kv_heads // self.size
            return first * D, (first + self.local_kv_heads) * D
        n = {"expert": self.expert_intermediate, "shared": self.shared_intermediate}.get(kind, self.intermediate)
        n //= self.size
        return self.rank * n, (self.rank + 1) * n

    def cut(self, name: str) -> tuple[int, tuple[slice, ...]] | None:
        """(dimension, slices along it, joined in order) of checkpoint tensor `name` this process holds, or None:
        it holds it whole. A block-FP8 weight's `weight_scale_inv` is cut as its weight, in blocks."""
        if name.endswith(SCALE) and self.block is not None:
            return self._scale_cut(name[:-len(SCALE)])
        if self.vocab and self.is_vocab(name):
            return 0, (slice(*self._range("vocab")),)
        if layer_index(name) is None:
            return None
        if self.expert_intermediate:
            expert = _EXPERT.search(name)
            if expert is not None:
                return (1 if expert.group(1) in EXPERT_ROW else 0), (slice(*self._range("expert")),)
            fused = _FUSED_EXPERTS.search(name)
            if fused is not None:          # [E, 2I, hidden] gate rows then up rows; [E, hidden, I]
                a, b = self._range("expert")
                if fused.group(1) == "down_proj":
                    return 2, (slice(a, b),)
                I = self.expert_intermediate
                return 1, (slice(a, b), slice(I + a, I + b))
        for part, kind in COLUMN.items():
            if f".{part}." in name:
                return 0, (slice(*self._range(kind)),)
        for part, kind in ROW.items():
            if f".{part}.weight" in name:
                return 1, (slice(*self._range(kind)),)
        return None

    def _scale_cut(self, weight: str) -> tuple[int, tuple[slice, ...]] | None:
        """The block scales of `weight`'s slices: rows [a, b) of the weight are scale rows [a / bm, ceil(b / bm))
        (columns likewise by bn). fp8_refusal has checked that every a falls on a block boundary."""
        cut = self.cut(weight)
        if cut is None:
            return None
        dim, parts = cut
        b = self.block[0] if splits_rows(weight, dim) else self.block[1]
        return dim, tuple(slice(sl.start // b, -(-sl.stop // b)) for sl in parts)


SCALE = "_scale_inv"


def splits_rows(weight: str, dim: int) -> bool:
    """Whether a cut of `weight` along `dim` splits its output rows (column-parallel) rather than its input
    columns (row-parallel): a matrix's dim 0, a fused experts tensor's [E, rows, columns] dim 1."""
    return dim == (1 if _FUSED_EXPERTS.search(weight) else 0)


def shard_of(config: dict, rank: int, size: int) -> Shard:
    heads = int(config["num_attention_heads"])
    latent = None
    if is_latent(config):              # every head caches its own expanded key and value: as many KV heads
        latent = (int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"]), int(config["v_head_dim"]))
    return Shard(rank, size, heads, heads if latent else int(config.get("num_key_value_heads") or heads),
                 int(config.get("head_dim") or int(config["hidden_size"]) // heads), int(config["intermediate_size"]),
                 expert_intermediate(config)[1], shared_intermediate(config), latent,
                 int(config.get("vocab_size") or 0), fp8_block(config))


def fp8_block(config: dict) -> tuple[int, int] | None:
    """A block-FP8 checkpoint's weight_block_size (None: unquantized, or a quantization family_of refuses)."""
    try:
        q = quantization_of(config)
    except QuantizationError:
        return None
    return None if q is None else q.block


def is_latent(config: dict) -> bool:
    """Multi-head latent attention (DeepSeek-V3)."""
    return bool(config.get("kv_lora_rank"))


def shared_intermediate(config: dict) -> int:
    """The shared experts' intermediate size (DeepSeek: n_shared_experts x moe_intermediate_size; 0: none)."""
    n = int(config.get("n_shared_experts") or 0)
    return n * int(config.get("moe_intermediate_size") or 0) if num_experts(config) > 1 else 0


def num_experts(config: dict) -> int:
    return int(next((config[k] for k in EXPERTS_KEYS if config.get(k)), 0))


def expert_intermediate(config: dict) -> tuple[str, int]:
    """(the field, the size) of a routed expert's intermediate dimension; ("", 0) for a dense model."""
    if num_experts(config) <= 1:
        return "", 0
    field = "moe_intermediate_size" if config.get("moe_intermediate_size") else "intermediate_size"
    return field, int(config[field])


def has_dense_mlp(config: dict) -> bool:
    """Whether some layer runs a dense MLP of intermediate_size: every layer of a dense model; of a Qwen3-MoE the
    layers `mlp_only_layers` and `decoder_sparse_step` leave dense, of a DeepSeek-V3 its first
    `first_k_dense_replace` (Mixtral's experts are of intermediate_size)."""
    if num_experts(config) <= 1:
        return True
    if config.get("model_type") == "deepseek_v3":       # its first first_k_dense_replace layers
        return int(config.get("first_k_dense_replace") or 0) > 0
    if config.get("model_type") != "qwen3_moe":
        return False
    step = int(config.get("decoder_sparse_step") or 1)
    return bool(config.get("mlp_only_layers")) or any((i + 1) % step for i in range(int(config["num_hidden_layers"])))


def refusal(config: dict, tp: int, field: str = "tensor_parallel_size", role: str = "target",
            instead: str | None = None) -> str | None:
    """Why a model's shape cannot be split over tp processes (None: it can), as a sentence naming `field` and what
    to change (`instead`: the advice in place of choosing another tp — a drafter's is to stay replicated)."""
    heads = int(config.get("num_attention_heads") or 0)
    kv = int(config.get("num_key_value_heads") or heads)
    inter = int(config.get("intermediate_size") or 0)
    e_field, expert = expert_intermediate(config)
    if heads % tp:
        why, advice = f"does not divide the {role}'s {heads} attention heads (num_attention_heads)", f"choose a divisor of {heads}"
    elif tp > kv and tp % kv and not is_latent(config):
        why, advice = (f"exceeds the {role}'s {kv} KV heads but is not a multiple of them (each process must hold "
                       f"whole KV heads)", f"choose a divisor or a multiple of {kv}")
    elif inter % tp and has_dense_mlp(config):
        why, advice = f"does not divide the {role}'s intermediate_size {inter}", "choose a divisor of it"
    # (DeepSeek's shared experts, n_shared_experts x moe_intermediate_size columns, divide whenever these do)
    elif expert and expert % tp:
        why, advice = (f"does not divide the {role}'s {e_field} {expert} (each routed expert's MLP columns are split "
                       f"over the TP group)", "choose a divisor of it")
    else:
        return None
    return f"{field} {tp} {why}: {instead or advice}."


def fp8_refusal(headers: dict[str, tuple[str, list[int]]], config: dict, tp: int, field: str = "tensor_parallel_size",
                instead: str | None = None) -> str | None:
    """Why a block-FP8 checkpoint (tensor headers: name -> (dtype, shape)) cannot be split over tp processes (None:
    it can): some process's slice of a quantized weight would start inside one of its blocks, where one scale
    covers rows (columns) of two processes. The names' layer and expert numbers are folded: each shape is checked
    once."""
    block = fp8_block(config)
    if tp <= 1 or block is None:
        return None
    shards = [shard_of(config, r, tp) for r in range(tp)]
    seen = set()
    for name, (_, shape) in headers.items():
        if not name.endswith(SCALE) or name[:-len(SCALE)] not in headers:
            continue
        weight = name[:-len(SCALE)]
        w_shape = headers[weight][1]
        key = (re.sub(r"\.\d+\.", ".*.", weight), tuple(w_shape))
        if key in seen:
            continue
        seen.add(key)
        for shard in shards:
            cut = shard.cut(weight)
            if cut is None or cut[0] >= len(w_shape):
                break
            dim, parts = cut
            rows = splits_rows(weight, dim)
            b, full = block[0 if rows else 1], w_shape[dim]
            bad = next((sl for sl in parts if sl.start % b or (sl.stop % b and sl.stop != full)), None)
            if bad is not None:
                at = bad.start if bad.start % b else bad.stop
                what = "output rows" if rows else "input columns"
                return (f"{field} {tp} would split the {what} of {weight} (shape {list(w_shape)}) at {at}, inside "
                        f"one of its FP8 blocks of {block[0]}x{block[1]} (one scale per block): each process must hold "
                        f"whole blocks, so every split must fall on a multiple of {b}; "
                        + (instead or "choose a tensor_parallel_size that splits them so, or use a high-precision "
                                      "checkpoint") + ".")
    return None


def held_fraction(name: str, shape: list[int], config: dict, tp: int) -> float:
    """The share of checkpoint tensor `name` (of `shape`) one process of tp holds (preflight's memory per GPU; of
    the embedding and LM head, split by vocabulary, its rows with the padding)."""
    if tp == 1:
        return 1.0
    cut = shard_of(config, 0, tp).cut(name)
    if cut is None or not shape:
        return 1.0
    dim, parts = cut
    return sum(sl.stop - sl.start for sl in parts) / shape[dim] if len(shape) > dim and shape[dim] else 1.0
