"""Continuous batching: one StepPlan per engine step, within a token and sequence budget.

Each step: running decodes first (one token each), then unfinished prompt chunks, then
new requests admitted from the waiting queue while blocks stay under `memory_threshold`.
New requests join the running batch at the next step; finished ones leave it and free
their blocks at once. When blocks run out mid-decode, the newest running sequence is
preempted: its blocks are freed and it is re-queued at the front to be recomputed from
its prompt plus the tokens it already produced, so its stream neither loses nor repeats
a token. The scheduler never touches tensors: it sends block ids and token counts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import structlog

from hetero.v1 import common_pb2, worker_pb2
from hetero_infer.config import Config
from hetero_infer.errors import DuplicateRequestError, ValidationError
from hetero_infer.sampling import resolve
from scheduler_svc.block_pool import BlockPool, OutOfBlocksError
from scheduler_svc.sequence import Sequence, SequenceStatus

log = structlog.get_logger("scheduler_svc.scheduler")
FR = common_pb2


@dataclass
class TokenOutput:
    """What one step produced for one request (the service turns it into a TokenEvent)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = FR.FINISH_REASON_UNSPECIFIED
    error: str = ""
    logprobs: list[float] = field(default_factory=list)
    timestamp: float = 0.0
    top_logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)  # per token, when asked
    queue_seconds: float = 0.0  # on the first output: arrival to first admission


class Scheduler:
    def __init__(self, config: Config, num_blocks: int, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(num_blocks)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, in admission order
        self.requests: dict[str, Sequence] = {}
        self.sequences: dict[int, Sequence] = {}  # by seq_id: how worker results find their sequence
        self._released: list[int] = []  # seq ids the worker should forget at the next step
        self._next_seq_id = 0
        self.step_id = 0
        self.num_preemptions = 0
        self._in_flight: list[worker_pb2.ScheduledSequence] = []

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: common_pb2.SamplingParams) -> Sequence:
        if request_id in self.requests:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight; use a unique id per request")
        if not prompt_token_ids:
            raise ValidationError("prompt_token_ids must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValidationError(f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len} "
                                  "and at least one token must be generated: shorten the prompt")
        needed = -(-(len(prompt_token_ids) + 1) // self.block_size)
        if needed > self.pool.num_blocks:
            raise ValidationError(f"prompt needs {needed} KV blocks but the pool has {self.pool.num_blocks}; "
                                  "shorten the prompt or raise max_num_blocks")
        seq = Sequence(self._next_seq_id, request_id, list(prompt_token_ids), len(prompt_token_ids), resolve(params), params)
        self._next_seq_id += 1
        self.requests[request_id] = seq
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str, reason: int = FR.FINISH_REASON_ABORT) -> bool:
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, reason, SequenceStatus.COMPLETED if reason != FR.FINISH_REASON_ERROR else SequenceStatus.FAILED)
        return True

    def has_pending_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- planning

    def schedule(self) -> worker_pb2.StepPlan:
        """Decide this step's batch. Blocks for the scheduled tokens are allocated here."""
        self.step_id += 1
        plan = worker_pb2.StepPlan(step_id=self.step_id)
        token_budget = self.config.max_total_tokens
        seq_budget = self.config.max_batch_size
        scheduled: list[tuple[Sequence, int]] = []

        # 1. Decodes, least recently scheduled first (fair when running > max_batch_size).
        decodes = sorted((s for s in self.running if s.status is SequenceStatus.DECODE), key=lambda s: s.last_scheduled_step)
        for seq in decodes:
            if seq_budget == 0 or token_budget == 0:
                break
            if seq.status is not SequenceStatus.DECODE:  # preempted by an earlier iteration
                continue
            if not self._reserve(seq, 1, protect=[s for s, _ in scheduled]):
                continue
            scheduled.append((seq, 1))
            seq_budget -= 1
            token_budget -= 1

        # 2. Prompts already admitted and partly computed (chunked prefill).
        for seq in [s for s in self.running if s.status is SequenceStatus.PREFILL]:
            if seq_budget == 0 or token_budget == 0:
                break
            n = self._chunk(seq, token_budget)
            if n and self._reserve(seq, n, protect=[s for s, _ in scheduled]):
                scheduled.append((seq, n))
                seq_budget -= 1
                token_budget -= n

        # 3. Admit waiting requests (FIFO; the head waits if it does not fit, keeping order).
        while self.waiting and seq_budget > 0 and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = self._chunk(seq, token_budget)
            if n == 0 or not self._admissible(seq, n):
                break
            self.waiting.popleft()
            if seq.queue_seconds is None:
                seq.queue_seconds = time.monotonic() - seq.arrival_time
            self._allocate(seq, n)
            seq.status = SequenceStatus.PREFILL
            self.running.append(seq)
            scheduled.append((seq, n))
            seq_budget -= 1
            token_budget -= n

        plan.released_seq_ids.extend(self._released)
        self._released.clear()
        for seq, n in scheduled:
            if not seq.on_worker:
                plan.new_sequences.append(worker_pb2.NewSequence(
                    seq_id=seq.seq_id, token_ids=seq.token_ids, params=seq.params, num_generated=seq.num_generated))
                seq.on_worker = True
            plan.scheduled.append(worker_pb2.ScheduledSequence(
                seq_id=seq.seq_id, num_tokens=n, new_block_ids=seq.block_table[seq.num_blocks_sent:],
                sample=seq.num_computed + n == seq.num_tokens, num_cached_tokens=seq.num_computed))
            seq.num_blocks_sent = len(seq.block_table)
            seq.last_scheduled_step = self.step_id
        self._in_flight = list(plan.scheduled)
        return plan

    def _chunk(self, seq: Sequence, token_budget: int) -> int:
        """How many of the sequence's uncomputed tokens fit this step (0 = none)."""
        remaining = seq.num_uncomputed
        if remaining <= token_budget:
            return remaining
        return token_budget if self.config.enable_chunked_prefill else 0

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def _admissible(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self._blocks_needed(seq, num_new_tokens)
        if needed > self.pool.num_free:
            return False
        if not self.running:
            return True  # never let the threshold starve an idle engine
        return self.pool.num_used + needed <= self.config.memory_threshold * self.pool.num_blocks

    def _allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        seq.block_table.extend(self.pool.allocate(self._blocks_needed(seq, num_new_tokens)))

    def _reserve(self, seq: Sequence, num_new_tokens: int, protect: list[Sequence]) -> bool:
        """Allocate blocks for the next tokens, preempting the newest other sequences if needed.

        Returns False when `seq` itself had to be preempted (nothing else could give way).
        """
        while True:
            try:
                self._allocate(seq, num_new_tokens)
                return True
            except OutOfBlocksError:
                victim = next((s for s in reversed(self.running) if s is not seq and s not in protect), None)
                if victim is None:
                    self._preempt(seq)
                    return False
                self._preempt(victim)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, re-queue at the front with all tokens so far."""
        self.running.remove(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_blocks_sent = 0
        if seq.on_worker:
            self._released.append(seq.seq_id)
            seq.on_worker = False
        seq.status = SequenceStatus.PENDING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        log.info("preempted", request_id=seq.request_id, tokens=seq.num_tokens, free_blocks=self.pool.num_free)

    # ---------------------------------------------------------------- results

    def process_result(self, result: worker_pb2.StepResult) -> list[TokenOutput]:
        """Apply one step's sampled tokens; return per-request outputs (finished ones included)."""
        now = time.time()
        for s in self._in_flight:
            seq = self.sequences.get(s.seq_id)
            if seq is not None and seq.status in (SequenceStatus.PREFILL, SequenceStatus.DECODE):
                seq.num_computed += s.num_tokens
        self._in_flight = []
        outputs: list[TokenOutput] = []
        logprobs = list(result.logprobs)
        for i, (seq_id, token) in enumerate(zip(result.seq_ids, result.token_ids)):
            seq = self.sequences.get(seq_id)
            if seq is None or seq.status.finished:
                continue  # aborted while the step ran
            seq.token_ids.append(token)
            seq.status = SequenceStatus.DECODE
            out = TokenOutput(seq.request_id, [token], timestamp=now, logprobs=[logprobs[i]] if logprobs else [])
            if seq.sampling.logprobs and result.num_top_logprobs:
                k, top = seq.sampling.logprobs, slice(i * result.num_top_logprobs, (i + 1) * result.num_top_logprobs)
                out.top_logprobs = [common_pb2.TopLogprobs(token_ids=result.top_token_ids[top][:k],
                                                           logprobs=result.top_logprobs[top][:k])]
            if seq.num_generated == 1:
                out.queue_seconds = seq.queue_seconds or 0.0
            reason = self._finish_reason(seq, token)
            if reason:
                self._finish(seq, reason, SequenceStatus.COMPLETED)
                out.finish_reason = reason
            outputs.append(out)
        return outputs

    def fail_all(self, error: str) -> list[TokenOutput]:
        """A step failed beyond retries: every admitted request ends with an error."""
        outputs = []
        for seq in list(self.requests.values()):
            self._finish(seq, FR.FINISH_REASON_ERROR, SequenceStatus.FAILED)
            outputs.append(TokenOutput(seq.request_id, finish_reason=FR.FINISH_REASON_ERROR, error=error))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> int:
        s = seq.sampling
        if (token in self.eos_token_ids and not s.ignore_eos) or token in s.stop_token_ids:
            return FR.FINISH_REASON_STOP
        if seq.num_generated >= s.max_tokens or seq.num_tokens >= self.max_model_len:
            return FR.FINISH_REASON_LENGTH
        return FR.FINISH_REASON_UNSPECIFIED

    def _finish(self, seq: Sequence, reason: int, status: SequenceStatus) -> None:
        seq.status = status
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        if seq.on_worker:
            self._released.append(seq.seq_id)
            seq.on_worker = False
        self.requests.pop(seq.request_id, None)
        self.sequences.pop(seq.seq_id, None)

    # ---------------------------------------------------------------- scale and resilience (issue 6)
    # Moving sequences off a worker that failed: they are recomputed from their prompt plus the
    # tokens already produced (as after a recompute preemption), here or on another replica.

    def take_all_for_recompute(self) -> list[Sequence]:
        """Remove every unfinished sequence, blocks freed, in arrival order; the worker's state is void."""
        seqs = sorted(self.requests.values(), key=lambda s: s.arrival_time)
        for seq in seqs:
            self.pool.release(seq.block_table)
            seq.block_table = []
            seq.num_computed = 0
            seq.num_blocks_sent = 0
            seq.on_worker = False
            seq.status = SequenceStatus.PENDING
        self.waiting.clear()
        self.running.clear()
        self.requests.clear()
        self.sequences.clear()
        self._released.clear()
        self._in_flight = []
        return seqs

    def adopt(self, seq: Sequence) -> None:
        """Queue a sequence taken from a replica (possibly this one) for recompute, under a new seq id."""
        seq.seq_id = self._next_seq_id
        self._next_seq_id += 1
        self.requests[seq.request_id] = seq
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)

    # ---------------------------------------------------------------- stats

    def pool_stats(self) -> common_pb2.PoolStats:
        allocated_slots = sum(len(s.block_table) for s in self.running) * self.block_size
        held_tokens = sum(min(s.num_tokens, len(s.block_table) * self.block_size) for s in self.running)
        used = self.pool.num_used
        return common_pb2.PoolStats(
            block_size=self.block_size, total_blocks=self.pool.num_blocks, used_blocks=used,
            free_blocks=self.pool.num_free, cached_blocks=0, usage=used / self.pool.num_blocks,
            num_running=len(self.running), num_waiting=len(self.waiting), num_preemptions=self.num_preemptions,
            internal_waste=(allocated_slots - held_tokens) / allocated_slots if allocated_slots else 0.0,
            steps=self.step_id,
        )
