"""A request's sequence as the scheduler sees it: token ids, block table, state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from hetero.v1 import common_pb2
from hetero_infer.sampling import Sampling


class SequenceStatus(enum.Enum):
    PENDING = "pending"  # waiting for admission (new, or preempted for recompute)
    PREFILL = "prefill"  # admitted, prompt not fully in the KV cache yet
    DECODE = "decode"  # generating one token per step
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.COMPLETED, SequenceStatus.FAILED)


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int
    sampling: Sampling
    params: common_pb2.SamplingParams  # forwarded to the worker as given
    status: SequenceStatus = SequenceStatus.PENDING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the cache
    num_blocks_sent: int = 0  # prefix of block_table the worker already has
    on_worker: bool = False  # the worker holds this sequence's state
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    arrival_time: float = field(default_factory=time.monotonic)
    last_scheduled_step: int = -1
    queue_seconds: float | None = None  # arrival to first admission (metrics)
    deadline: float | None = None  # time.monotonic() after which the request is dropped (the caller's gRPC deadline)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed
