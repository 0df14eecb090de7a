"""The requests in flight, by request id and by seq id, and their samples' entry and exit.

A request is one sample (one `Sequence`) or, with `n > 1`, sample 0 and the samples it forks once
its prompt is computed. It is in flight while any of its samples is unfinished; each sample also
has a seq id, by which the worker's results name it (a new one when it is adopted after a replica
failed, `Scheduler.adopt`). A sample that ends gives its blocks back and the worker is told to
forget it; the scheduler takes it off whichever queue it was in.
"""

from __future__ import annotations

from scheduler_svc.core.overlap import drop_placeholders
from scheduler_svc.core.result_reader import ResultReader
from scheduler_svc.core.step_plan import WorkerOutbox, disarm
from scheduler_svc.kv.kv_cache_manager import KVCacheManager
from scheduler_svc.sequence import Sequence, SequenceStatus, fork_sample
from scheduler_svc.speculation.speculation import Speculator


class RequestTable:
    """The requests in flight; a sample's entry and exit, and with its exit the state its features kept about it
    (its blocks, what the worker holds, its prompt logprobs, its drafting)."""

    __slots__ = ("requests", "samples", "sequences", "_kv_cache", "_outbox", "_results", "_speculator")

    def __init__(self, kv_cache: KVCacheManager, outbox: WorkerOutbox, results: ResultReader,
                 speculator: Speculator | None) -> None:
        self.requests: dict[str, Sequence] = {}  # request id -> sample 0, while any sample is unfinished
        self.samples: dict[str, list[Sequence]] = {}  # request id -> its unfinished samples
        self.sequences: dict[int, Sequence] = {}  # seq id -> sample: how worker results find their sequence
        self._kv_cache, self._outbox = kv_cache, outbox
        self._results, self._speculator = results, speculator

    def add(self, seq: Sequence) -> None:
        """A new request, its sample 0."""
        self.requests[seq.info.request_id] = seq
        self.samples[seq.info.request_id] = [seq]
        self.sequences[seq.seq_id] = seq

    def add_sample(self, seq: Sequence) -> None:
        """Another sample of a request: a fork, or a sample adopted from a replica (possibly the first of
        its request here, which stands for the request until sample 0 comes)."""
        self.samples.setdefault(seq.info.request_id, []).append(seq)
        if seq.info.index == 0 or seq.info.request_id not in self.requests:
            self.requests[seq.info.request_id] = seq
        self.sequences[seq.seq_id] = seq

    def fork(self, parent: Sequence, index: int, seq_id: int) -> Sequence:
        """Sample `index` of the parent's request, whose prompt is computed: it shares the parent's prompt
        blocks by reference (kv_cache_manager.py)."""
        child = fork_sample(parent, index, seq_id)
        self._kv_cache.fork(parent, child)
        disarm(parent)  # its blocks are shared now: its next write may need a copy
        self.add_sample(child)
        return child

    def end(self, seq: Sequence, status: SequenceStatus) -> None:
        """A sample is done: blocks freed, the worker told; its request leaves with its last sample."""
        seq.status = status
        self._kv_cache.forget(seq)  # what its features kept about it goes (`_forget`, inlined: once per sample)
        self._results.prompt_logprobs.pop(seq.seq_id, None)
        if self._speculator is not None:
            self._speculator.forget(seq)
        self._outbox.release(seq)
        self.sequences.pop(seq.seq_id, None)
        live = self.samples.get(seq.info.request_id, [])
        if seq in live:
            live.remove(seq)
        if not live:
            self.samples.pop(seq.info.request_id, None)
            self.requests.pop(seq.info.request_id, None)

    def of(self, request_id: str, index: int | None = None) -> list[Sequence]:
        """A request's unfinished samples (only sample `index`, if given)."""
        return [s for s in self.samples.get(request_id, []) if index is None or s.info.index == index]

    def take_all(self) -> list[Sequence]:
        """Every unfinished sample out of the table, in arrival order (a request's by index), to be computed
        again from its tokens: blocks freed, a token still in flight dropped (its step is lost)."""
        seqs = sorted((s for samples in self.samples.values() for s in samples),
                      key=lambda s: (s.info.arrival_time, s.info.index))
        drop_placeholders(seqs)
        for seq in seqs:
            self._forget(seq)
            seq.reset_for_recompute()
        self.requests.clear()
        self.samples.clear()
        self.sequences.clear()
        return seqs

    def _forget(self, seq: Sequence) -> None:
        """What the sample's features kept about it goes: its blocks, prompt logprobs and drafting."""
        self._kv_cache.forget(seq)
        self._results.forget(seq)
        if self._speculator is not None:
            self._speculator.forget(seq)
