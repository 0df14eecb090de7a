"""Prefix-cache block hashes: a chain over full blocks, so a hash names a whole prefix.

hash(block i) = H(hash(block i-1) | token ids of block i | cache salt). A cached block is
reused only when its hash *and* its stored token ids match (see `BlockPool.lookup`), so a
hash collision can never hand a request another prompt's K/V; with the chain, equal hashes
at block i mean equal prefixes up to block i. blake2b keeps collisions out of practice.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np


def block_hash(parent: bytes, tokens: tuple[int, ...], salt: str = "") -> bytes:
    h = blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if salt:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_full_blocks: int,
                  salt: str = "") -> list[bytes]:
    """Append the hashes of full blocks len(hashes)..num_full_blocks-1 to `hashes` (in place)."""
    for i in range(len(hashes), num_full_blocks):
        parent = hashes[i - 1] if i else b""
        hashes.append(block_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), salt))
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[bytes]:
    """The chained hashes of every full block of `token_ids` (a partial last block has none)."""
    return extend_hashes([], token_ids, block_size, len(token_ids) // block_size, salt)
