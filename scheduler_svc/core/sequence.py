"""A request's sequence as the scheduler sees it: token ids, block table, state.

A request with `n > 1` samples is one Sequence per sample: sample 0 computes the prompt,
then forks the others, which share its prompt blocks by reference (copy-on-write).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from hetero.v1 import common_pb2
from hetero_common.sampling import Sampling, sample_seed
from scheduler_svc.core.prompt_logprobs import PromptLogprobs, needs_prompt_logits
from scheduler_svc.kv.block_pool import blocks_for
from scheduler_svc.kv.prefix_cache import pack_ids
from scheduler_svc.speculation.draft_state import DraftState


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


# eq=False: a sequence is itself, not its fields. Finding one in the running list compares
# identities, where a field-by-field __eq__ built two tuples of every field per comparison.
# slots: attribute reads in the scheduler's per-sequence loops are cheaper.
@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int
    sampling: Sampling
    params: common_pb2.SamplingParams  # forwarded to the worker as given
    index: int = 0  # which sample of the request (n > 1)
    cache_salt: str = ""
    lora_slot: int = 0  # the LoRA adapter it is served with, by worker slot (0: the base model)
    pooling: int = 0  # common_pb2.Pooling: an embedding request (prefill only, its vector pooled by the worker)
    priority: int = 0  # lower is admitted first and preempted last (vLLM's convention)
    pending_forks: int = 0  # samples still to fork from this one once its prompt is computed
    status: SequenceStatus = SequenceStatus.PENDING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the cache
    num_blocks_sent: int = 0  # prefix of block_table the worker already has
    on_worker: bool = False  # the worker holds this sequence's state
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hashes of full blocks so far
    num_registered: int = 0  # leading blocks of block_table offered to the prefix cache
    pending_edits: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write table edits to send
    swapped_status: SequenceStatus | None = None  # status to return to after a swap-in
    num_swapped_blocks: int = 0  # blocks the worker holds in host memory for this sequence
    cached_prompt_tokens: int | None = None  # prefix-cache hit at first admission (None: not admitted yet)
    first_output_sent: bool = False
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    arrival_time: float = field(default_factory=time.monotonic)
    last_scheduled_step: int = -1
    queue_seconds: float | None = None  # arrival to first admission (metrics)
    deadline: float | None = None  # time.monotonic() after which the request is dropped (the caller's gRPC deadline)
    prompt_logprobs: PromptLogprobs | None = None  # filled step by step until the first token (prompt_logprobs.py)
    # The scheduler's decode fast path (step_plan.write_entry): while len(token_ids) <= fast_until, a decode
    # needs no block and its plan entry is decode_head + num_cached_tokens' varint. 0: take the general path.
    fast_until: int = 0
    decode_head: bytes = b""
    # Overlap (scheduler_svc/core/overlap.py): the step in flight samples this sequence's next token, and the
    # next step was planned before it came back; token_ids ends with a placeholder for it until then.
    awaiting_token: bool = False
    # Speculative decoding (speculation.py): its decodes may carry proposals (never on the fast path), and the
    # n-gram index they come from with their adaptive length (built at its first proposal).
    speculative: bool = False
    drafting: DraftState | None = None
    # prompt + max_tokens - 1: a token sampled when the sequence holds this many (or more) ends it by length.
    last_len: int = field(init=False, default=0)
    # The first len(packed_ids) // 4 token ids as little-endian uint32s (`packed`).
    packed_ids: bytes = b""

    def __post_init__(self) -> None:
        self.last_len = self.prompt_len + self.sampling.max_tokens - 1

    def packed(self, count: int) -> bytes:
        """At least the first `count` token ids as packed by prefix_cache.pack_ids: the prefix-cache hashes
        and the worker's new-sequence entry read the same bytes, packed once (ids before `count` never
        change; only the overlap's placeholder, never packed, is replaced in place)."""
        have = len(self.packed_ids) >> 2
        if have < count:
            self.packed_ids += pack_ids(self.token_ids[have:count])
        return self.packed_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs still to deliver: every prompt position must be computed (no prefix-cache hit)."""
        return needs_prompt_logits(self.params, self.index, self.first_output_sent)

    @property
    def computes_whole_prompt(self) -> bool:
        """No prefix-cache hit may stand in for a prompt position: its logprobs are asked for, or it is an
        embedding request (a vector from another chunking would differ in its last bits)."""
        return bool(self.pooling) or self.needs_prompt_logits

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def reset_for_recompute(self) -> None:
        """Back to waiting, to be computed again from all its tokens (its blocks already freed)."""
        self.pending_edits = []
        self.num_computed = self.num_blocks_sent = self.num_swapped_blocks = 0
        self.on_worker = False
        self.fast_until = 0
        self.status, self.swapped_status = SequenceStatus.PENDING, None


def fork_sample(parent: Sequence, index: int, seq_id: int, block_size: int) -> Sequence:
    """Sample `index` of the parent's request, forked once the parent's prompt is computed.

    It holds the parent's prompt blocks (the caller takes the references) and recomputes
    only the last prompt token, to draw its own first token; that write lands in a shared
    block, so the scheduler copies the block first (copy-on-write).
    """
    params = common_pb2.SamplingParams()
    params.CopyFrom(parent.params)
    if params.HasField("seed"):  # distinct but reproducible samples
        params.seed = sample_seed(params.seed, index)
    params.ClearField("prompt_logprobs")  # sample 0 carries them; the worker scores no prompt token for this one
    prompt_blocks = blocks_for(parent.prompt_len, block_size)
    return Sequence(seq_id, parent.request_id, parent.token_ids[:parent.prompt_len], parent.prompt_len, parent.sampling,
                    params, index=index, cache_salt=parent.cache_salt, lora_slot=parent.lora_slot, priority=parent.priority,
                    status=SequenceStatus.DECODE,
                    block_table=parent.block_table[:prompt_blocks], num_computed=parent.prompt_len - 1,
                    block_hashes=list(parent.block_hashes), speculative=parent.speculative,
                    num_registered=min(parent.num_registered, (parent.prompt_len - 1) // block_size),
                    cached_prompt_tokens=parent.cached_prompt_tokens)
