"""The chained hash of a sequence's full KV blocks (prefix caching: `kv_cache.BlockPool`; prefix-aware routing in
the server's frontend). Torch-free: the frontend process uses it too."""
from __future__ import annotations

import hashlib
import struct


def block_hashes(tokens: list[int], block_size: int, known: list[bytes], n_blocks: int) -> list[bytes]:
    """The chained hashes of the first `n_blocks` full blocks of `tokens`, extending `known` (those already
    worked out for the same tokens) in place: block i's hash covers every token up to its end."""
    start = len(known)
    if n_blocks > start:
        # the new blocks' tokens packed once, then one sha256 call a block: the rank's step loop hashes every
        # admitted prompt (a 1,500-token one's 95 blocks: 178 us with a numpy conversion and a hash object a
        # block, 83 us so, on the development machine)
        part = tokens[start * block_size:n_blocks * block_size]
        data = struct.pack(f"<{len(part)}q", *part)        # int64, little-endian
        width = block_size * 8
        prev = known[-1] if known else b"specdp"
        for at in range(0, (n_blocks - start) * width, width):
            prev = hashlib.sha256(prev + data[at:at + width]).digest()
            known.append(prev)
    return known[:n_blocks]


HASH_BYTES = 32     # sha256


def joined(hashes: list[bytes]) -> bytes:
    """Block hashes as one bytes value for the link (one value to encode and decode, not one per block)."""
    return b"".join(hashes)


def split(blob: bytes) -> list[bytes]:
    # one struct call (a 1,500-token prompt's 95 hashes: 2 against 8 µs sliced one by one)
    return list(struct.unpack(f"{HASH_BYTES}s" * (len(blob) // HASH_BYTES), blob))
