"""Tensor parallelism of the dense decoder (Megatron's split): which part of each weight a process holds.

Column-parallel (a slice of the output rows): q_proj by query heads, k_proj / v_proj by KV heads, gate_proj /
up_proj by intermediate columns, with their biases. Row-parallel (a slice of the input columns): o_proj and
down_proj; their products are partial sums that the decoder all-reduces over the TP group before adding the
(whole) bias. Everything else — embedding, norms, per-head q/k norms, the LM head — is held whole (vocab-parallel
embedding and LM head are a later step).

KV heads: split when tp divides them; when tp exceeds them (tp a multiple of their number) each process holds the
one KV head its query heads read, so a KV head is replicated tp / KV times.

What the engine checks before loading (preflight: `refusal`), and what it loads (`Shard.cut`, read straight from
the safetensors file: a process never holds another's slice).
"""
from __future__ import annotations

from dataclasses import dataclass

from .naming import layer_index

COLUMN = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv", "mlp.gate_proj": "inter",
          "mlp.up_proj": "inter"}
ROW = {"self_attn.o_proj": "q", "mlp.down_proj": "inter"}


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    heads: int               # the model's query heads
    kv_heads: int
    head_dim: int
    intermediate: int

    @property
    def local_heads(self) -> int:
        return self.heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.kv_heads // self.size)

    def _range(self, kind: str) -> tuple[int, int]:
        """[first, end) of this process's rows (column-parallel) or columns (row-parallel) of a `kind` dimension."""
        D = self.head_dim
        if kind == "q":
            return self.rank * self.local_heads * D, (self.rank + 1) * self.local_heads * D
        if kind == "kv":
            if self.size <= self.kv_heads:
                first = self.rank * self.local_kv_heads
            else:                                  # replicated: the KV head of this process's query heads
                first = self.rank * self.kv_heads // self.size
            return first * D, (first + self.local_kv_heads) * D
        n = self.intermediate // self.size
        return self.rank * n, (self.rank + 1) * n

    def cut(self, name: str) -> tuple[int, slice] | None:
        """(dimension, slice) of checkpoint tensor `name` this process holds, or None: it holds it whole."""
        if layer_index(name) is None:
            return None
        for part, kind in COLUMN.items():
            if f".{part}." in name:
                a, b = self._range(kind)
                return 0, slice(a, b)
        for part, kind in ROW.items():
            if f".{part}.weight" in name:
                a, b = self._range(kind)
                return 1, slice(a, b)
        return None


def shard_of(config: dict, rank: int, size: int) -> Shard:
    heads = int(config["num_attention_heads"])
    return Shard(rank, size, heads, int(config.get("num_key_value_heads") or heads),
                 int(config.get("head_dim") or int(config["hidden_size"]) // heads), int(config["intermediate_size"]))


def refusal(config: dict, tp: int) -> str | None:
    """Why a target's shape cannot be split over tp processes (None: it can), as a sentence naming
    tensor_parallel_size and what to change."""
    heads = int(config.get("num_attention_heads") or 0)
    kv = int(config.get("num_key_value_heads") or heads)
    inter = int(config.get("intermediate_size") or 0)
    if heads % tp:
        return (f"tensor_parallel_size {tp} does not divide the target's {heads} attention heads "
                f"(num_attention_heads): choose a divisor of {heads}.")
    if tp > kv and tp % kv:
        return (f"tensor_parallel_size {tp} exceeds the target's {kv} KV heads but is not a multiple of them "
                f"(each process must hold whole KV heads): choose a divisor or a multiple of {kv}.")
    if inter % tp:
        return (f"tensor_parallel_size {tp} does not divide the target's intermediate_size {inter}: choose a "
                f"divisor of it.")
    return None


def held_fraction(name: str, shape: list[int], config: dict, tp: int) -> float:
    """The share of checkpoint tensor `name` (of `shape`) one process of tp holds (preflight's memory per GPU)."""
    if tp == 1:
        return 1.0
    cut = shard_of(config, 0, tp).cut(name)
    if cut is None or not shape:
        return 1.0
    dim, sl = cut
    return (sl.stop - sl.start) / shape[dim] if len(shape) > dim and shape[dim] else 1.0
