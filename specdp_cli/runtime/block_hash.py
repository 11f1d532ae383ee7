"""The chained hash of a sequence's full KV blocks (prefix caching: `kv_cache.BlockPool`; prefix-aware routing in
the server's frontend). Torch-free: the frontend process uses it too."""
from __future__ import annotations

import hashlib

import numpy as np


def block_hashes(tokens: list[int], block_size: int, known: list[bytes], n_blocks: int) -> list[bytes]:
    """The chained hashes of the first `n_blocks` full blocks of `tokens`, extending `known` (those already
    worked out for the same tokens) in place: block i's hash covers every token up to its end."""
    for i in range(len(known), n_blocks):
        h = hashlib.sha256(known[-1] if known else b"specdp")
        h.update(np.asarray(tokens[i * block_size:(i + 1) * block_size], dtype=np.int64).tobytes())
        known.append(h.digest())
    return known[:n_blocks]
