"""Prefix-cache block hashes: a chain over full blocks, so a hash names a whole prefix.

hash(block i) = H(hash(block i-1) | token ids of block i | cache salt). A cached block is
reused only when its hash *and* its stored token ids match (see `BlockPool.lookup`), so a
hash collision can never hand a request another prompt's K/V; with the chain, equal hashes
at block i mean equal prefixes up to block i. blake2b keeps collisions out of practice.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import blake2b

_PACKERS: dict[int, struct.Struct] = {}


def _int64s(count: int) -> struct.Struct:
    """The packer of `count` native int64s: the bytes numpy's int64 array of the same ids holds, made in a
    fifth of the time (a block is hashed once per admission or fill; a list-to-array conversion was most of it)."""
    packer = _PACKERS.get(count)
    if packer is None:
        packer = _PACKERS[count] = struct.Struct(f"{count}q")
    return packer


def block_hash(parent: bytes, tokens: Sequence[int], salt: str = "") -> bytes:
    h = blake2b(parent, digest_size=16)
    h.update(_int64s(len(tokens)).pack(*tokens))
    if salt:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_full_blocks: int,
                  salt: str = "") -> list[bytes]:
    """Append the hashes of full blocks len(hashes)..num_full_blocks-1 to `hashes` (in place)."""
    for i in range(len(hashes), num_full_blocks):
        parent = hashes[i - 1] if i else b""
        hashes.append(block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], salt))
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[bytes]:
    """The chained hashes of every full block of `token_ids` (a partial last block has none)."""
    return extend_hashes([], token_ids, block_size, len(token_ids) // block_size, salt)
