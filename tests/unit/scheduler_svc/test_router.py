"""Data-parallel routing policies over the router's own index of routed prompt blocks."""

from __future__ import annotations

import struct
from hashlib import sha256

from scheduler_svc.kv.prefix_cache import block_hashes, extend_hashes, pack_ids
from scheduler_svc.replicas.router import Router


def test_block_hashes_are_chained_over_full_blocks() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 3)
    assert len(a) == 2  # the partial last block is not hashed
    assert block_hashes([9, 2, 3, 4, 5, 6], 3)[1] != a[1]  # block 1's hash depends on block 0


def test_extend_hashes_is_block_hash_chained_with_the_salt_and_resumes() -> None:
    def block_hash(parent: bytes, tokens: list[int], salt: str) -> bytes:  # the format, written out
        return sha256(parent + struct.pack(f"<{len(tokens)}I", *tokens) + (b"\x00salt\x00" + salt.encode() if salt else b"")).digest()

    ids = list(range(3, 20))
    for salt in ("", "tenant-a"):
        chain = [block_hash(b"", ids[0:4], salt)]
        for i in range(1, 4):
            chain.append(block_hash(chain[-1], ids[4 * i:4 * i + 4], salt))
        assert block_hashes(ids, 4, salt) == chain
        assert extend_hashes(chain[:2], pack_ids(ids), 4, 4, salt) == chain  # picks up after the hashes it has
    assert block_hashes(ids, 4, "tenant-a") != block_hashes(ids, 4)


def test_round_robin_alternates() -> None:
    router = Router("round_robin", 2, 3)
    assert [router.choose([1, 2], [0, 1, 2], {}).replica for _ in range(4)] == [0, 1, 2, 0]
    assert router.choose([1, 2], [0, 2], {}).replica in (0, 2)  # a replica that is down is skipped


def test_longest_prefix_follows_the_longest_match_and_balances_ties() -> None:
    router = Router("longest_prefix", 2, 2)
    group_a, group_b = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    assert router.choose(group_a, [0, 1], {0: 0, 1: 0}).replica == 0
    assert router.choose(group_b, [0, 1], {0: 1, 1: 0}).replica == 1  # no match anywhere: least loaded
    decision = router.choose(group_a[:4] + [42, 43], [0, 1], {0: 5, 1: 0})
    assert (decision.replica, decision.matched_blocks, decision.prompt_blocks) == (0, 2, 3)  # prefix beats load
    assert router.blocks_hit == 2 and router.blocks_queried == 3 + 2 + 3
    router.forget(0)
    assert router.choose(group_a, [0, 1], {0: 0, 1: 1}).matched_blocks == 0


def test_first_prefix_block_and_capacity() -> None:
    router = Router("first_prefix_block", 2, 2, capacity_blocks=2)
    router.choose([1, 2, 3, 4], [0, 1], {0: 0, 1: 0})
    assert router.choose([1, 2, 9, 9], [0, 1], {0: 3, 1: 0}).replica == 0
    router.choose([5, 6, 7, 8], [0], {})  # replica 0's index holds 2 blocks: the oldest go
    assert router.choose([1, 2], [0, 1], {0: 0, 1: 1}).matched_blocks == 0
