"""How checkpoints name their tensors' places (no torch: preflight reads these from safetensors headers)."""
from __future__ import annotations

import re

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor belongs to (`model.layers.{i}.…`), None for the others."""
    m = _LAYER.search(name)
    return None if m is None else int(m.group(1))


def expert_split(num_experts: int, world: int, rank: int) -> range:
    """The routed experts rank `rank` of `world` holds under expert parallelism: contiguous, the first
    (num_experts % world) ranks one more (3 ranks, 4 experts: 0-1, 2, 3)."""
    base, extra = divmod(num_experts, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
