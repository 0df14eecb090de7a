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

from collections.abc import Sequence
from hashlib import sha256

from scheduler_svc.sequence import pack_ids


def extend_hashes(hashes: list[bytes], packed: bytes, block_size: int, num_full_blocks: int, salt: str = "") -> list[bytes]:
    """Append the hashes of full blocks len(hashes)..num_full_blocks-1 to `hashes` (in place), from the ids
    packed by `pack_ids` (scheduler_svc/sequence.py; at least num_full_blocks * block_size of them): sha256(parent
    hash | the block's packed ids | salt marker and salt, when salted), on slices of bytes (one call per block: every
    admission hashes its prompt's full blocks)."""
    start = len(hashes)
    salted = b"\x00salt\x00" + salt.encode() if salt else b""
    parent = hashes[-1] if start else b""
    width = 4 * block_size
    for i in range(start, num_full_blocks):
        parent = sha256(parent + packed[i * width:(i + 1) * width] + salted).digest()
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "") -> list[bytes]:
    """The chained hashes of every full block of `token_ids` (a partial last block has none)."""
    full = len(token_ids) // block_size
    return extend_hashes([], pack_ids(token_ids[:full * block_size]), block_size, full, salt)
