"""Property-based tests: the block pool and the scheduler under random interleavings of
submit (n = 1..3, so forks), step, abort (whole requests and single samples), preemption
(recompute and swap), eviction and suspend/resume, with and without speculative drafts (n-gram proposals
over these small token ids match often; the paper model's own choices accept some and reject others).

The worker's part is `PaperWorker`: a pure-Python model of the paged KV cache that applies
each StepPlan exactly as the contract says (released, swap_out, swap_in, block copies, new
sequences, table edits, appended blocks) and "writes" token ids into slots instead of K/V.
Before it computes, it checks that every slot the sequence would attend to holds that
sequence's token: any sharing, copy-on-write, swap or prefix-cache mistake shows up there.
The scheduler and block pool are the real ones.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero.v1 import common_pb2, worker_pb2
from hetero_common.config import Config
from scheduler_svc.core.scheduler import Scheduler, plan_needs_worker
from scheduler_svc.kv.block_pool import BlockPool

BLOCK = 4
NUM_BLOCKS = 24
EOS = 2


class PaperWorker:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: dict[int, dict] = {}
        self.host: dict[int, list[list[int | None]]] = {}

    def drop_cache(self) -> None:  # suspend in recompute mode: the tensor is gone
        self.kv = [[None] * self.bs for _ in self.kv]

    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        for sid in plan.released_seq_ids:
            self.seqs.pop(sid, None)
            self.host.pop(sid, None)
        for sw in plan.swap_out:
            self.host[sw.seq_id] = [list(self.kv[b]) for b in sw.block_ids]
            self.seqs[sw.seq_id]["table"] = []
        for sw in plan.swap_in:
            saved = self.host.pop(sw.seq_id)
            assert len(saved) == len(sw.block_ids)
            for b, content in zip(sw.block_ids, saved):
                self.kv[b] = list(content)
            self.seqs[sw.seq_id]["table"] = list(sw.block_ids)
        for c in plan.block_copies:
            self.kv[c.dst] = list(self.kv[c.src])
        for new in plan.new_sequences:
            self.seqs[new.seq_id] = {"tokens": list(new.token_ids), "table": [], "computed": -1}
        result = worker_pb2.StepResult(step_id=plan.step_id)
        drafted = any(s.draft_token_ids or s.num_draft_model_tokens for s in plan.scheduled)
        for s in plan.scheduled:
            st_ = self.seqs[s.seq_id]
            for e in s.block_table_edits:
                st_["table"][e.index] = e.block_id
            st_["table"] += list(s.new_block_ids)
            if st_["computed"] < 0:
                st_["computed"] = s.num_cached_tokens
            assert st_["computed"] == s.num_cached_tokens
            tokens, table = st_["tokens"], st_["table"]
            for pos in range(s.num_cached_tokens):  # what attention would read
                assert self.kv[table[pos // self.bs]][pos % self.bs] == tokens[pos], f"seq {s.seq_id} pos {pos}"
            end = s.num_cached_tokens + s.num_tokens
            drafts = list(s.draft_token_ids) or self.propose(tokens, s.seq_id, s.num_draft_model_tokens)
            assert end == len(tokens) + len(drafts) if drafts else end <= len(tokens)
            for pos, token in zip(range(s.num_cached_tokens, end), tokens[s.num_cached_tokens:] + drafts):
                self.kv[table[pos // self.bs]][pos % self.bs] = token
            st_["computed"] = end
            if s.sample:
                kept = []  # the drafts this model would have chosen one at a time, then its own token
                token = self.choose(tokens, s.seq_id)
                while len(kept) < len(drafts) and drafts[len(kept)] == token:
                    kept.append(token)
                    token = self.choose(tokens + kept, s.seq_id)
                tokens += kept + [token]
                if drafts:  # the rejected drafts' slots are garbage until overwritten; blocks past the tokens go
                    st_["computed"] = len(tokens) - 1
                    del table[-(-len(tokens) // self.bs):]
                result.seq_ids.append(s.seq_id)
                result.token_ids.append(token)
                if drafted:
                    result.num_accepted_drafts.append(len(kept))
                    result.accepted_draft_ids.extend(kept)
        return result

    @classmethod
    def propose(cls, tokens: list[int], seq_id: int, count: int) -> list[int]:
        """The paper draft model's `count` proposals: the model's own choices, but wrong at every third
        position, so that runs of drafts are kept and cut at every place."""
        drafts: list[int] = []
        for j in range(count):
            token = cls.choose(tokens + drafts, seq_id)
            drafts.append(token if (len(tokens) + j) % 3 else 3 + (token - 2) % 5)
        return drafts

    @staticmethod
    def choose(tokens: list[int], seq_id: int) -> int:
        """The paper model's next token after `tokens`."""
        return 3 + (sum(tokens) * 31 + len(tokens) + seq_id) % 5


def check_invariants(s: Scheduler, worker: PaperWorker) -> None:
    pool = s.kv_cache.pool
    # the KV manager keeps a record for each unfinished sample and for no other: none leaks when a sample ends
    assert s.kv_cache.num_tracked == len(s.sequences), (s.kv_cache.num_tracked, len(s.sequences))
    holders = Counter(b for seq in s.sequences.values() for b in s.kv_cache.table(seq))
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == holders[b], f"block {b}: ref {pool.ref_counts[b]}, held by {holders[b]} tables"
        assert not (pool.is_free(b) and pool.ref_counts[b] > 0), f"block {b} is free and referenced"
        assert pool.is_free(b) or pool.ref_counts[b] > 0, f"block {b} is neither free nor referenced"
    free = pool.free_blocks()
    assert len(free) == pool.num_free
    cached_free = sum(1 for b in free if pool.block_hash[b] is not None)
    assert cached_free == pool.num_cached_free
    assert (pool.num_free - cached_free) + pool.num_used + cached_free == pool.num_blocks
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h
        assert tuple(worker.kv[b]) == pool.block_tokens[b], f"cached block {b} does not hold its tokens"
    if pool.cache_freed_blocks is False:
        assert pool.num_cached_free == 0


PREFIXES = [[3, 4, 5, 6, 7, 3, 4, 5], [6, 6, 6, 6, 5, 5, 5, 5, 4]]

ops = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.lists(st.integers(3, 8), max_size=7), st.integers(1, 6),
              st.integers(1, 3)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50), st.integers(-1, 2)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
    st.tuples(st.just("evict"), st.integers(1, 6)),
    st.tuples(st.just("suspend"), st.sampled_from(["persist", "offload", "recompute"])),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=st.lists(ops, max_size=40), policy=st.sampled_from(["lru", "ref_zero"]),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(), chunk=st.sampled_from([0, 3]),
       drafts=st.integers(0, 3), method=st.sampled_from(["ngram", "draft"]))
def test_random_interleavings_keep_the_pool_consistent(operations, policy, mode, caching, chunk, drafts, method) -> None:
    speculation = ({"speculative_method": method, "num_speculative_tokens": drafts, "prompt_lookup_min": 1,
                    "speculative_model": "paper" if method == "draft" else ""} if drafts else {})
    config = Config(dtype="float32", block_size=BLOCK, max_total_tokens=12, max_batch_size=6, memory_threshold=1.0,
                    enable_prefix_caching=caching, prefix_caching_eviction_policy=policy, preemption_mode=mode,
                    max_prefill_chunk_tokens=chunk, **speculation).validate()
    s = Scheduler(config, NUM_BLOCKS, (EOS,), max_model_len=64)
    worker = PaperWorker(NUM_BLOCKS, BLOCK)
    submitted = 0
    for op in operations:
        if op[0] == "submit":
            _, prefix, tail, max_tokens, n = op
            prompt = (PREFIXES[prefix] if prefix < 2 else []) + tail or [3]
            params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n)
            s.add_request(f"r{submitted}", prompt, params)
            submitted += 1
        elif op[0] == "step":
            plan = s.schedule()
            if plan_needs_worker(plan):  # as the replica and the engine decide
                s.process_result(worker.execute(plan))
        elif op[0] == "abort" and s.samples:
            rid = sorted(s.samples)[op[1] % len(s.samples)]
            s.abort(rid, index=None if op[2] < 0 else op[2])
        elif op[0] == "preempt" and s.running and not s._in_flight.entries:
            s._preempt(s.running[op[1] % len(s.running)])
            # In the service a preemption happens inside schedule(), and a swap-out leaves with
            # that step's plan: nothing can come between them.
            plan = s.schedule()
            if plan_needs_worker(plan):
                s.process_result(worker.execute(plan))
        elif op[0] == "evict":
            # Another user takes blocks off the free list's head (evicting cached ones) and gives them back.
            taken = s.kv_cache.pool.allocate(min(op[1], s.kv_cache.pool.num_free))
            worker_kv_garbage(worker, taken)
            s.kv_cache.pool.release(taken)
        elif op[0] == "suspend":
            s.suspend(op[1])
            if op[1] == "recompute":
                worker.drop_cache()
            assert not s.has_pending_work()
            s.resume()
        check_invariants(s, worker)
    # Run everything to the end: every request finishes and no block stays in use.
    for _ in range(2000):
        if not s.has_pending_work():
            break
        s.process_result(worker.execute(s.schedule()))
        check_invariants(s, worker)
    assert not s.has_pending_work() and not s.requests and not s.samples
    assert s.kv_cache.pool.num_used == 0
    check_invariants(s, worker)


def worker_kv_garbage(worker: PaperWorker, blocks: list[int]) -> None:
    for b in blocks:  # whoever took them wrote something else there
        worker.kv[b] = [-1] * worker.bs


def test_free_list_revives_a_cached_block_in_constant_time() -> None:
    pool = BlockPool(4, cache_freed_blocks=True)
    a = pool.allocate(3)
    pool.register(a[1], b"h1", (1, 2))
    pool.release(a)  # tail first: a[2], a[1], a[0] join the free list in that order
    assert pool.free_blocks() == [3, a[2], a[1], a[0]] and pool.num_cached_free == 1
    assert pool.lookup(b"h1", (1, 2)) == a[1] and pool.lookup(b"h1", (9, 9)) is None  # collision guard
    pool.touch(a[1])  # unlinked from the middle of the list
    assert pool.free_blocks() == [3, a[2], a[0]] and pool.ref_counts[a[1]] == 1 and pool.num_cached_free == 0
    pool.release([a[1]])
    assert pool.allocate(4) and not pool.cached  # reusing the block evicted its hash


def test_ref_zero_forgets_a_block_when_its_last_user_frees_it() -> None:
    pool = BlockPool(2, cache_freed_blocks=False)
    (b,) = pool.allocate(1)
    pool.register(b, b"h", (1,))
    pool.share(b)
    pool.release([b])
    assert pool.lookup(b"h", (1,)) == b
    pool.release([b])
    assert pool.lookup(b"h", (1,)) is None and pool.num_cached_free == 0
