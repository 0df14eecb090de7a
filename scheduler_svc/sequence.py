"""A sample as the scheduler sees it: what identifies it, its tokens, and where it stands. A plain record.

A request with `n > 1` samples is one Sequence per sample: sample 0 computes the prompt, then forks the
others, which share its prompt blocks by reference (copy-on-write, `kv/`).

Every room of the scheduler reads this record, so it imports none of them. What a feature keeps about a
sequence lives in the feature's own room, keyed by `seq_id`: its blocks, their prefix-cache hashes and what
the worker was sent of its table (`kv.kv_cache_manager`), the status a swapped sequence returns to
(`kv.swapped_queue`), its speculative drafting (`speculation/`), its prompt logprobs (`core.result_reader`),
whether the worker holds it (`core.step_plan.WorkerOutbox`). What never changes after a sample is made is in
its `SampleInfo`, shared by reference and read through properties.
"""

from __future__ import annotations

import enum
import struct
import time
from collections.abc import Sequence as ListLike
from dataclasses import dataclass, field, replace

from hetero.v1 import common_pb2
from hetero_common.sampling import Sampling, sample_seed


class SequenceStatus(enum.Enum):
    PENDING = "pending"  # waiting for admission (new, or preempted for recompute)
    PREFILL = "prefill"  # admitted, prompt not fully in the KV cache yet
    DECODE = "decode"  # generating one token per step
    SWAPPED = "swapped"  # preempted; its KV blocks are in the worker's host memory
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.COMPLETED, SequenceStatus.FAILED)


@dataclass(frozen=True, slots=True)
class SampleInfo:
    """What a sample is and is asked for, fixed when it is made (a fork gets its own: its seed differs)."""

    request_id: str
    prompt_len: int
    sampling: Sampling
    params: common_pb2.SamplingParams  # forwarded to the worker as given
    index: int = 0  # which sample of the request (n > 1)
    cache_salt: str = ""
    lora_slot: int = 0  # the LoRA adapter it is served with, by worker slot (0: the base model)
    pooling: int = 0  # common_pb2.Pooling: an embedding request (prefill only, its vector pooled by the worker)
    priority: int = 0  # lower is admitted first and preempted last (vLLM's convention)
    speculative: bool = False  # its decodes may carry speculative drafts (speculation/)
    deadline: float | None = None  # time.monotonic() after which the request is dropped (the caller's gRPC deadline)
    arrival_time: float = field(default_factory=time.monotonic)


def pack_ids(token_ids: ListLike[int]) -> bytes:
    """Token ids as little-endian uint32s: the prefix cache's hash input, and the worker's NewSequence.token_ids
    (fixed32), so a sequence packs its ids once for both (`Sequence.packed`). A fifth of the time of a
    list-to-numpy conversion. Only ids the worker computes get here, never the overlap's placeholder."""
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


# eq=False: a sequence is itself, not its fields. Finding one in the running list compares
# identities, where a field-by-field __eq__ built two tuples of every field per comparison.
# slots: attribute reads in the scheduler's per-sequence loops are cheaper.
@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int  # the worker's name for it (a new one when a replica adopts it: `Scheduler.adopt`)
    info: SampleInfo
    token_ids: list[int]  # prompt followed by generated tokens
    status: SequenceStatus = SequenceStatus.PENDING
    num_computed: int = 0  # tokens whose K/V is in the cache
    pending_forks: int = 0  # samples still to fork from this one once its prompt is computed
    last_scheduled_step: int = -1  # the scheduler's: the step that last scheduled it (this step's batch)
    # The plan writer's decode fast path (core/step_plan.write_entry): while len(token_ids) <= fast_until, a decode
    # needs no block and its plan entry is decode_head + num_cached_tokens' varint. 0: take the general path.
    fast_until: int = 0
    decode_head: bytes = b""
    # Overlap (core/overlap.py): the step in flight samples this sequence's next token, and the next step was
    # planned before it came back; token_ids ends with a placeholder for it until then.
    awaiting_token: bool = False
    first_output_sent: bool = False
    queue_seconds: float | None = None  # arrival to first admission (metrics)
    cached_prompt_tokens: int | None = None  # prefix-cache hit at first admission (None: not admitted yet)
    # A token sampled when the sequence holds this many (or more) ends it by length: prompt + max_tokens - 1, and
    # at most max_model_len - 1 once the scheduler that holds it says its max_model_len (`cap_length`).
    last_len: int = field(init=False, default=0)
    # The first len(packed_ids) // 4 token ids as little-endian uint32s (`packed`).
    packed_ids: bytes = b""

    def __post_init__(self) -> None:
        self.last_len = self.info.prompt_len + self.info.sampling.max_tokens - 1

    @classmethod
    def new(cls, seq_id: int, request_id: str, token_ids: list[int], prompt_len: int, sampling: Sampling,
            params: common_pb2.SamplingParams, status: SequenceStatus = SequenceStatus.PENDING, num_computed: int = 0,
            pending_forks: int = 0, **info: object) -> Sequence:
        """A sequence and its SampleInfo in one call (`info`: SampleInfo's other fields by name)."""
        sample = SampleInfo(request_id, prompt_len, sampling, params, **info)  # type: ignore[arg-type]
        return cls(seq_id, sample, token_ids, status, num_computed, pending_forks)

    # What never changes, read through the info (properties: the hot loops read the mutable fields only).
    request_id = property(lambda self: self.info.request_id)
    prompt_len = property(lambda self: self.info.prompt_len)
    sampling = property(lambda self: self.info.sampling)
    params = property(lambda self: self.info.params)
    index = property(lambda self: self.info.index)
    cache_salt = property(lambda self: self.info.cache_salt)
    lora_slot = property(lambda self: self.info.lora_slot)
    pooling = property(lambda self: self.info.pooling)
    priority = property(lambda self: self.info.priority)
    speculative = property(lambda self: self.info.speculative)
    deadline = property(lambda self: self.info.deadline)
    arrival_time = property(lambda self: self.info.arrival_time)

    def cap_length(self, max_model_len: int) -> None:
        """The scheduler that holds the sequence serves at most `max_model_len` tokens: a token sampled at
        max_model_len - 1 tokens ends it by length too (one comparison per token, where two were made)."""
        self.last_len = min(self.info.prompt_len + self.info.sampling.max_tokens, max_model_len) - 1

    def packed(self, count: int) -> bytes:
        """At least the first `count` token ids as packed by `pack_ids`: the prefix-cache hashes and the worker's
        new-sequence entry read the same bytes, packed once (ids before `count` never change; only the
        overlap's placeholder, never packed, is replaced in place)."""
        have = len(self.packed_ids) >> 2
        if have < count:
            self.packed_ids += pack_ids(self.token_ids[have:count])
        return self.packed_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.info.prompt_len

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs still to deliver (core/prompt_logprobs.py): every prompt position must be computed
        (no prefix-cache hit). Only sample 0 carries them, on its first output."""
        return self.info.index == 0 and not self.first_output_sent and self.info.params.HasField("prompt_logprobs")

    @property
    def computes_whole_prompt(self) -> bool:
        """No prefix-cache hit may stand in for a prompt position: its logprobs are asked for, or it is an
        embedding request (a vector from another chunking would differ in its last bits)."""
        return bool(self.info.pooling) or self.needs_prompt_logits

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def reset_for_recompute(self) -> None:
        """Back to waiting, to be computed again from all its tokens (its blocks already freed)."""
        self.num_computed = self.fast_until = 0
        self.status = SequenceStatus.PENDING


def fork_sample(parent: Sequence, index: int, seq_id: int) -> Sequence:
    """Sample `index` of the parent's request, forked once the parent's prompt is computed.

    It will hold the parent's prompt blocks (`KVCacheManager.fork`) and recomputes only the last prompt
    token, to draw its own first token; that write lands in a shared block, which is copied first
    (copy-on-write)."""
    params = common_pb2.SamplingParams()
    params.CopyFrom(parent.params)
    if params.HasField("seed"):  # distinct but reproducible samples
        params.seed = sample_seed(params.seed, index)
    params.ClearField("prompt_logprobs")  # sample 0 carries them; the worker scores no prompt token for this one
    info = replace(parent.info, index=index, params=params, arrival_time=time.monotonic())  # arrives as it forks
    child = Sequence(seq_id, info, parent.token_ids[:parent.prompt_len], SequenceStatus.DECODE, parent.prompt_len - 1)
    child.cached_prompt_tokens, child.last_len = parent.cached_prompt_tokens, parent.last_len  # the same cap
    return child
