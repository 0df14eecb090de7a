"""Prefix-cache block hashes: a chain over full blocks, so a hash names a whole prefix.

hash(block i) = H(hash(block i-1) | token ids of block i | cache salt). A cached block is
reused only when its hash *and* its stored token ids match (see `BlockPool.lookup`), so a
hash collision can never hand a request another prompt's K/V; with the chain, equal hashes
at block i mean equal prefixes up to block i. H is SHA-256 (as vLLM's default), which keeps
collisions out of practice, over the ids as uint32s (the protocol's type): on x86 with the
SHA extensions that and the packing take 1.9 µs for a 256-token block, where blake2b over
int64s took 3.4 (every admission hashes its prompt's full blocks; scheduler_bench.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import sha256

_PACKERS: dict[int, struct.Struct] = {}


def _uint32s(count: int) -> struct.Struct:
    """The packer of `count` little-endian uint32s (a fifth of the time of a list-to-numpy conversion).
    Only computed tokens are hashed, so the overlap's placeholder id (-1, overlap.py) never reaches it."""
    packer = _PACKERS.get(count)
    if packer is None:
        packer = _PACKERS[count] = struct.Struct(f"<{count}I")
    return packer


def block_hash(parent: bytes, tokens: Sequence[int], salt: str = "") -> bytes:
    h = sha256(parent)
    h.update(_uint32s(len(tokens)).pack(*tokens))
    if salt:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_full_blocks: int,
                  salt: str = "") -> list[bytes]:
    """Append the hashes of full blocks len(hashes)..num_full_blocks-1 to `hashes` (in place): `block_hash`
    inlined, since every admission hashes its prompt's full blocks."""
    start = len(hashes)
    if start >= num_full_blocks:
        return hashes
    pack = _uint32s(block_size).pack
    salted = b"\x00salt\x00" + salt.encode() if salt else b""
    parent = hashes[-1] if start else b""
    for i in range(start, num_full_blocks):
        parent = sha256(parent + pack(*token_ids[i * block_size:(i + 1) * block_size]) + salted).digest()
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[bytes]:
    """The chained hashes of every full block of `token_ids` (a partial last block has none)."""
    return extend_hashes([], token_ids, block_size, len(token_ids) // block_size, salt)
