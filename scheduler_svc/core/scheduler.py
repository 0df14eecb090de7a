"""The core scheduler: continuous batching, one StepPlan per engine step within a token and sequence budget.

`Scheduler.schedule` decides a step in four phases: the running decodes (one token each, or drafts with it:
speculation.py), the prompts partly computed (chunked prefill), swapped-out sequences back, new requests admitted
(lower priority value first, then arrival) while blocks stay under `memory_threshold`. When blocks run out, a running
sequence is preempted (`preemption_victim`, at the end); its stream neither loses nor repeats a token. A request with
n > 1 samples forks after its prompt. `process_result` applies the worker's sampled tokens.

The Scheduler owns the queues and makes every decision; the collaborators own the rest: the blocks (`KVCacheManager`),
the requests in flight (`RequestTable`), what the worker is to be told and the plan's wire bytes (step_plan.py), the
step in flight (overlap.py), reading a result (`ResultReader`). It never touches tensors or reference counts.
"""

from __future__ import annotations

import time
from operator import attrgetter

import structlog

from hetero.v1 import common_pb2, worker_pb2
from hetero_common.config import Config
from hetero_common.device_defaults import SEED_MAX_BATCH_SIZE
from hetero_common.errors import DuplicateRequestError
from hetero_common.sampling import resolve
from scheduler_svc.core.overlap import StepInFlight
from scheduler_svc.core.request_limits import RequestLimits
from scheduler_svc.core.request_table import RequestTable
from scheduler_svc.core.result_reader import ResultReader
from scheduler_svc.core.stats import pool_stats
from scheduler_svc.core.step_plan import SMALL_VARINTS, PlanWriter, WorkerOutbox, disarm, plan_needs_worker
from scheduler_svc.core.token_output import StepOutputs, TokenOutput
from scheduler_svc.core.waiting_queue import WaitingQueue
from scheduler_svc.kv.kv_cache_manager import KVCacheManager
from scheduler_svc.kv.swapped_queue import SwappedQueue
from scheduler_svc.sequence import Sequence, SequenceStatus
from scheduler_svc.speculation.speculation import Speculator

log = structlog.get_logger("scheduler_svc.core.scheduler")
FR = common_pb2
PREFILL, DECODE = SequenceStatus.PREFILL, SequenceStatus.DECODE
COMPLETED, FAILED = SequenceStatus.COMPLETED, SequenceStatus.FAILED  # tested with `is`: an Enum's hash is Python code
_last_scheduled = attrgetter("last_scheduled_step")


class Scheduler:
    def __init__(self, config: Config, num_blocks: int, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.config, self.block_size = config, config.block_size
        self.max_batch_size = config.max_batch_size or SEED_MAX_BATCH_SIZE  # set from the worker's (replica._join)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                       cache_freed_blocks=config.prefix_caching_eviction_policy == "lru")
        self.eos_token_ids = frozenset(eos_token_ids)
        self._limits = RequestLimits(max_model_len, num_blocks, self.block_size)
        self.max_model_len = self._limits.max_model_len  # at most the KV pool's capacity
        self.speculator = Speculator(config, self.max_model_len) if config.speculative_method != "none" else None
        self._results = ResultReader(self.eos_token_ids, self.max_model_len, self.speculator)
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []  # admitted, in admission order
        self.swapped = SwappedQueue()  # preempted to host memory, oldest first
        self._outbox = WorkerOutbox()  # block copies, swap-outs and released seq ids for the next plans
        # in flight: `requests`, `samples`, `sequences`
        self._table = RequestTable(self.kv_cache, self._outbox, self._results, self.speculator)
        self._next_seq_id = 0
        self.step_id = 0
        self.num_preemptions = 0
        self.num_planned_ahead = 0  # plans made while the step before was in flight (overlap.py)
        self.num_swap_outs = 0
        self.suspended = False
        # All of `running` was scheduled in the last step, so it is in the decode pass's order (cleared by forks).
        self._running_in_order = False
        self._in_flight = StepInFlight()  # the last plan's entries, fast decodes aside, and the step planned ahead of

    @property
    def num_blocks(self) -> int:
        """The KV pool's size in blocks."""
        return self.kv_cache.num_blocks

    @property
    def requests(self) -> dict[str, Sequence]:
        """Request id -> sample 0, for every request in flight (read only: request_table.py)."""
        return self._table.requests

    @property
    def samples(self) -> dict[str, list[Sequence]]:
        """Request id -> its unfinished samples (read only)."""
        return self._table.samples

    @property
    def sequences(self) -> dict[int, Sequence]:
        """Seq id -> unfinished sample (read only)."""
        return self._table.sequences

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: common_pb2.SamplingParams,
                    cache_salt: str = "", priority: int = 0, lora_slot: int = 0, pooling: int = 0,
                    deadline: float | None = None, block_hashes: list[bytes] | None = None) -> Sequence:
        """Queue a request; `pooling` (common_pb2.Pooling): an embedding, whose prompt is computed and pooled.
        `deadline`: time.monotonic() after which it is dropped; `block_hashes`: its prompt's prefix-cache hashes,
        when the router computed them already."""
        if request_id in self.requests:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight; use a unique id per request")
        sampling = resolve(params)
        self._limits.check_request(len(prompt_token_ids), sampling.n, pooling)
        seq = Sequence.new(self._next_seq_id, request_id, list(prompt_token_ids), len(prompt_token_ids), sampling,
                           params, pending_forks=sampling.n - 1, cache_salt=cache_salt, priority=priority,
                           speculative=self.speculator is not None and not pooling, lora_slot=lora_slot,
                           pooling=pooling, deadline=deadline)
        self._next_seq_id += 1
        seq.cap_length(self.max_model_len)
        self.kv_cache.add(seq, block_hashes)
        self._results.watch_stop_ids(sampling.stop_token_ids)
        self._table.add(seq)
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str, reason: int = FR.FINISH_REASON_ABORT, index: int | None = None) -> list[int]:
        """End a request's samples (or only sample `index`); return the indices ended (empty: none in flight)."""
        seqs = self._table.of(request_id, index)
        status = COMPLETED if reason != FR.FINISH_REASON_ERROR else FAILED
        for seq in seqs:
            seq.pending_forks = 0
            self._finish(seq, status)
        return [seq.info.index for seq in seqs]

    def on_worker(self, seq: Sequence) -> bool:
        """Whether the worker holds the sequence's state (sent whole and not released since)."""
        return self._outbox.holds(seq)

    def has_pending_work(self) -> bool:
        return not self.suspended and bool(self.waiting or self.running or self.swapped)

    # ---------------------------------------------------------------- suspend / resume

    def suspend(self, mode: str) -> None:
        """Pause planning. `recompute`: the worker drops its KV tensor, so every running sequence
        is re-queued for recomputation and the prefix cache is forgotten."""
        self.suspended = True
        if mode == "recompute":
            for seq in reversed(list(self.running)):
                self._preempt_recompute(seq)
            self.kv_cache.reset_prefix_cache()
        log.info("suspended", mode=mode, waiting=len(self.waiting), swapped=len(self.swapped))

    def resume(self) -> None:
        self.suspended = False

    # ---------------------------------------------------------------- planning

    def schedule(self) -> worker_pb2.StepPlan:
        """Decide this step's batch, in four phases: the running decodes, the prompts partly computed,
        swapped-out sequences back, new requests admitted. Blocks for the scheduled tokens are allocated
        here (preempting others when they run out); the plan tells the worker what to compute with them."""
        if self.suspended:
            return worker_pb2.StepPlan(step_id=self.step_id)
        self.step_id += 1
        writer = PlanWriter(self.kv_cache, self._outbox)
        # This step's entries but its fast decodes: (sequence, tokens to compute). A scheduled sequence's
        # last_scheduled_step is this step_id: that marks the batch, which no preemption may pick (O(1)).
        scheduled: list[tuple[Sequence, int]] = []
        seq_budget, token_budget, prompts_seen = self._schedule_decodes(writer, scheduled)
        num_decodes = len(scheduled)  # their entries are written; the prompts' are written after them
        if prompts_seen:
            seq_budget, token_budget = self._schedule_prompt_chunks(scheduled, seq_budget, token_budget)
        if self.swapped:
            self._swap_in(writer)
        seq_budget, token_budget = self._admit_waiting(scheduled, seq_budget, token_budget)
        for seq, n in scheduled[num_decodes:]:
            writer.entry(seq, n)
        self._in_flight.record(scheduled, writer.drafted)
        if self.speculator is not None:  # the step's tokens, for what a token costs (step_cost.py)
            self.speculator.planned(self.step_id, self.config.max_total_tokens - token_budget, len(self.running))
        # One each for all of `running`: it is in the next decode pass's order already.
        self._running_in_order = self.max_batch_size - seq_budget == len(self.running)
        return writer.plan(self.step_id)

    def _schedule_decodes(self, writer: PlanWriter, scheduled: list[tuple[Sequence, int]]) -> tuple[int, int, bool]:
        """Phase 1: the running decodes, one token each, least recently scheduled first (fair when running >
        max_batch_size: a stable sort, about one pass; none when the last step scheduled all of `running`).
        Returns the budgets left, and whether a prompt still computing was met (phase 2's work: this loop
        breaks only when the budgets are spent, and phase 2's with them). A decode whose next token fits in
        blocks it holds alone and whose entry is the plain one (step_plan.write_entry: fast_until) takes the
        fast path: scheduled, and its entry written, with no call. `room`: the decodes the budgets still
        allow, counted down by the fast path; the budgets themselves are brought up to date by the rest."""
        step_id, write, small = self.step_id, writer.parts.extend, SMALL_VARINTS
        seq_budget, token_budget = self.max_batch_size, self.config.max_total_tokens
        allocate_slots = self.kv_cache.allocate_slots
        room = room_at_sync = min(seq_budget, token_budget)
        prompts_seen = False
        for seq in list(self.running) if self._running_in_order else sorted(self.running, key=_last_scheduled):
            if room == 0:
                break
            if seq.status is not DECODE:  # a prompt still computing, or preempted by an earlier iteration
                prompts_seen = prompts_seen or seq.status is PREFILL
                continue
            num = len(seq.token_ids)
            if num <= seq.fast_until and num - seq.num_computed == 1:  # not in `scheduled`: ResultReader counts it
                seq.last_scheduled_step = step_id
                write((seq.decode_head, small[num - 1]))  # the entry write_entry armed (inlined: a call costs)
                room -= 1
                continue
            seq_budget -= room_at_sync - room
            token_budget -= room_at_sync - room
            n = num - seq.num_computed  # 1, or a forked sample recomputing its last prompt token
            if n == 0:
                continue  # planned ahead, and the token in flight ends it by length (overlap.py)
            if n <= token_budget:  # allocate_slots: _reserve's first try, made here (most decodes need no more)
                copies, drafts, asked = (self.speculator.allocate(seq, token_budget, self.kv_cache)  # type: ignore[union-attr]
                                         if seq.info.speculative and n == 1 else (allocate_slots(seq, n), (), 0))
                if copies is not None or self._reserve(seq, n):
                    if copies:
                        self._outbox.copy_blocks(copies)
                    seq.last_scheduled_step = step_id
                    scheduled.append((seq, n))
                    writer.entry(seq, n, drafts, asked)
                    seq_budget -= 1
                    token_budget -= n + len(drafts) + asked
            room = room_at_sync = min(seq_budget, token_budget)
        return seq_budget - (room_at_sync - room), token_budget - (room_at_sync - room), prompts_seen

    def _schedule_prompt_chunks(self, scheduled: list[tuple[Sequence, int]], seq_budget: int,
                                token_budget: int) -> tuple[int, int]:
        """Phase 2: prompts already admitted and partly computed (chunked prefill); returns the budgets left."""
        for seq in [s for s in self.running if s.status is PREFILL]:
            if seq_budget == 0 or token_budget == 0:
                break
            if seq.status is not PREFILL:  # preempted by an earlier iteration
                continue
            n = chunk_size(self.config, seq, token_budget)
            if n and self._reserve(seq, n):
                seq.last_scheduled_step = self.step_id
                scheduled.append((seq, n))
                seq_budget -= 1
                token_budget -= n
        return seq_budget, token_budget

    def _swap_in(self, writer: PlanWriter) -> None:
        """Phase 3: swapped-out sequences come back, oldest first, while their blocks fit, before anything
        new is admitted. Not while a block copy is pending: a swap-in lands before the copies on the worker
        and could overwrite a source."""
        while self.swapped and not self._outbox.copies_pending and len(self.running) < self.config.max_num_seqs:
            ready = self.swapped.pop_ready(self.kv_cache)
            if ready is None:
                break
            seq, block_ids, seq.status = ready
            writer.swap_in(seq, block_ids)
            self.running.append(seq)

    def _admit_waiting(self, scheduled: list[tuple[Sequence, int]], seq_budget: int,
                       token_budget: int) -> tuple[int, int]:
        """Phase 4: waiting requests admitted (priority, then FIFO; the head waits if it does not fit, keeping
        order), while nothing is swapped out; returns the budgets left."""
        while (self.waiting and not self.swapped and seq_budget > 0 and token_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting.peek()
            if seq.awaiting_token:
                break  # preempted while its token was in flight: admitted once it is back (overlap.py)
            hits = self.kv_cache.match_prefix(seq)
            n = chunk_size(self.config, seq, token_budget, num_computed=len(hits) * self.block_size)
            # The memory threshold never starves an idle engine: with nothing running, every block may be used.
            max_used = self.config.memory_threshold * self.num_blocks if self.running else self.num_blocks
            if n == 0 or not self.kv_cache.can_admit(hits, n, max_used):
                break
            self.waiting.popleft()
            first = seq.cached_prompt_tokens is None
            seq.num_computed = self.kv_cache.admit(seq, hits, n, first)
            if first:  # the prefix-cache hit a prompt's usage reports (not again after a preemption)
                seq.cached_prompt_tokens = min(seq.num_computed, seq.info.prompt_len)
            seq.status = PREFILL
            if seq.queue_seconds is None:  # arrival to first admission (metrics)
                seq.queue_seconds = time.monotonic() - seq.info.arrival_time
            self.running.append(seq)
            seq.last_scheduled_step = self.step_id
            scheduled.append((seq, n))
            seq_budget -= 1
            token_budget -= n
        return seq_budget, token_budget

    def plan_ahead(self) -> worker_pb2.StepPlan | None:
        """The next step's plan while the last one is still in flight (overlap.py), assuming its outcome; None when
        it must wait for that step's result (or drafts would be proposed: speculation.py). It runs right after it."""
        if self.suspended or not self._in_flight.may_plan_ahead(self.step_id) or (
                self.speculator is not None and self.speculator.wants_drafts(self.running)):
            return None
        self._in_flight.assume(self.step_id, self.running, self.kv_cache, self.max_model_len)
        plan = self.schedule()
        plan.after_step_id = self._in_flight.assumed_step
        self.num_planned_ahead += plan_needs_worker(plan)
        return plan

    def _reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Allocate (and copy-on-write) blocks for the next tokens, preempting others not in this step's batch
        (lowest priority, then newest) if needed. Returns False when `seq` itself had to be preempted."""
        while True:
            copies = self.kv_cache.allocate_slots(seq, num_new_tokens)
            if copies is not None:
                self._outbox.copy_blocks(copies)
                return True
            victim = preemption_victim(self.running, seq, self.step_id, self.waiting.any_priority)
            self._preempt(victim)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence) -> None:
        """Take a running sequence off the batch (`preemption_victim`), by swapping when it has K/V on the worker."""
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self._outbox.holds(seq) and seq.num_computed > 0:
            self._swap_out(seq)
        else:
            self._preempt_recompute(seq)

    def _preempt_recompute(self, seq: Sequence) -> None:
        """Free the blocks, re-queue at the front of its priority class with all tokens so far."""
        self.running.remove(seq)
        self.kv_cache.free(seq)
        self._outbox.release(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        log.info("preempted", mode="recompute", request_id=seq.info.request_id, tokens=seq.num_tokens,
                 free_blocks=self.kv_cache.num_free)

    def _swap_out(self, seq: Sequence) -> None:
        """The worker copies the blocks holding K/V to host memory; the device blocks are freed."""
        self.running.remove(seq)
        held = self.kv_cache.swap_out(seq)
        disarm(seq)  # its blocks are gone; the worker keeps its state
        self._outbox.swap_out(seq.seq_id, held)
        self.swapped.add(seq)
        seq.status = SequenceStatus.SWAPPED
        self.num_swap_outs += 1
        log.info("preempted", mode="swap", request_id=seq.info.request_id, blocks=len(held),
                 free_blocks=self.kv_cache.num_free)

    # ---------------------------------------------------------------- results

    def process_result(self, result: worker_pb2.StepResult) -> StepOutputs:
        """Apply one step's sampled tokens; return per-sample outputs (finished ones included)."""
        if not self._in_flight.counted(result.step_id):  # a step planned ahead of was counted then
            self._in_flight.count(self.kv_cache)  # before any row frees blocks
        read = self._results.read(result, self._table.sequences)
        if self.speculator is not None:
            self.speculator.settle(self._in_flight.take_drafted(), read.drafts_accepted, self.kv_cache, result)
        for parent in read.forks:  # before any sample ends: the forks take their blocks from the parent's
            self._fork_samples(parent)
        if read.ends:
            self._end_samples(read.ends)
        return read.outputs

    def _fork_samples(self, parent: Sequence) -> None:
        """Samples 1..n-1 of a request whose prompt is computed, sharing its prompt blocks by reference."""
        for index in range(1, parent.pending_forks + 1):
            self.running.append(self._table.fork(parent, index, self._next_seq_id))
            self._next_seq_id += 1
        self._running_in_order = False  # the children were never scheduled
        parent.pending_forks = 0

    def _end_samples(self, ends: list[tuple[Sequence, SequenceStatus, bool]]) -> None:
        """End the samples a result ended (result_reader.StepRead.ends), in row order. Those that ran leave
        `running` together afterwards: a few one by one (a search in C each), many in one pass."""
        ran = []
        for seq, status, in_running in ends:
            if in_running:
                self._table.end(seq, status)
                ran.append(seq)
            else:
                self._finish(seq, status)
        if len(ran) <= 8:
            for seq in ran:
                self.running.remove(seq)
        else:
            self.running = [q for q in self.running if q.status is not COMPLETED]

    def fail_all(self, error: str) -> StepOutputs:
        """A step failed beyond retries: every admitted request ends with an error."""
        if self._in_flight.forget_assumed():  # a step planned ahead of offered its blocks to the prefix cache before it ran
            self.kv_cache.reset_prefix_cache()
        outputs = []
        for rid, seqs in list(self.samples.items()):
            for seq in list(seqs):
                self._finish(seq, FAILED)
                outputs.append(TokenOutput(rid, finish_reason=FR.FINISH_REASON_ERROR, error=error,
                                           index=seq.info.index))
        return StepOutputs.of(outputs)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self._outbox.cancel_swap_out(seq.seq_id)
        elif seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._table.end(seq, status)

    # ---------------------------------------------------------------- scale and resilience

    def take_all_for_recompute(self) -> list[Sequence]:
        """Remove every unfinished sample, blocks freed, in arrival order; the worker's state is void (it
        failed): they are recomputed from their tokens so far, here or on another replica (`adopt`). The
        prefix cache is forgotten too: a step that failed half-way may have written into blocks."""
        seqs = self._table.take_all()
        for queue in (self.waiting, self.running, self.swapped, self._outbox):
            queue.clear()
        self._in_flight.clear()
        self.kv_cache.reset_prefix_cache()
        return seqs

    def adopt(self, seq: Sequence) -> None:
        """Queue a sample taken from a replica (possibly this one) for recompute, under a new seq id."""
        seq.seq_id = self._next_seq_id
        self._next_seq_id += 1
        seq.cap_length(self.max_model_len)  # this replica's (its KV pool's capacity may differ)
        self.kv_cache.add(seq)
        self._results.watch_stop_ids(seq.info.sampling.stop_token_ids)
        self._table.add_sample(seq)
        self.waiting.append(seq)

    def pool_stats(self) -> common_pb2.PoolStats:
        return pool_stats(self)


# ---------------------------------------------------------------- chunked prefill
# How much of a sequence's uncomputed tokens (a prompt, or a recompute's tokens) one step computes, within
# the step's token budget, `max_prefill_chunk_tokens`, and `enable_chunked_prefill`.

def chunk_size(config: Config, seq: Sequence, token_budget: int, num_computed: int | None = None) -> int:
    """How many of the sequence's uncomputed tokens (past `num_computed`, else its own count) fit this step
    (0 = none: without chunked prefill, all of them fit or none)."""
    remaining = seq.num_tokens - (seq.num_computed if num_computed is None else num_computed)
    if not config.enable_chunked_prefill:
        return remaining if remaining <= token_budget else 0
    cap = config.max_prefill_chunk_tokens or token_budget
    return min(remaining, token_budget, cap)


# ---------------------------------------------------------------- whom to preempt
# The scheduler preempts a running sequence that is not in this step's batch so that another can grow
# (`Scheduler._reserve`), in one of two ways (`Scheduler._preempt`): `recompute` frees its blocks and re-queues
# it at the front of its priority class with every token so far (prompt plus output), to be computed again;
# `swap` has the worker copy its blocks to host memory, and it waits in the `SwappedQueue` until it fits again.
# Either way its stream neither loses nor repeats a token.

def preemption_victim(running: list[Sequence], seq: Sequence, step_id: int, any_priority: bool) -> Sequence:
    """Whom to preempt so that `seq` can grow: the lowest-priority running sequence (highest value)
    not in this step's batch, among equals the newest; `seq` itself when none can give way, or
    when its own priority is strictly lower than every candidate's. `any_priority` False (every
    priority 0 so far) takes the plain newest-first path, which is all FIFO needs."""
    if not any_priority:
        return next((s for s in reversed(running) if s is not seq and s.last_scheduled_step != step_id), seq)
    victim = None
    for s in reversed(running):  # newest first; only a strictly larger value replaces, so ties keep the newest
        if s is not seq and s.last_scheduled_step != step_id and (
                victim is None or s.info.priority > victim.info.priority):
            victim = s
    return seq if victim is None or seq.info.priority > victim.info.priority else victim
