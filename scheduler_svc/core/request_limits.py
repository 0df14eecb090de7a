"""What one request may ask of a scheduler's KV pool and model: checked when it is submitted, so that
a request that could never run is refused at once instead of waiting (or preempting itself) forever."""

from __future__ import annotations

import structlog

from hetero.v1 import common_pb2
from hetero_common.errors import ValidationError
from scheduler_svc.kv.block_pool import blocks_for

log = structlog.get_logger("scheduler_svc.core.scheduler")  # the scheduler's warning, under its name


class RequestLimits:
    __slots__ = ("max_model_len", "num_blocks", "block_size")

    def __init__(self, max_model_len: int, num_blocks: int, block_size: int) -> None:
        capacity = num_blocks * block_size
        if max_model_len > capacity:
            # A sequence longer than the whole pool would preempt itself forever: it stops with finish
            # reason length at the pool's capacity instead.
            log.warning("max_model_len lowered to the KV pool's capacity", max_model_len=max_model_len,
                        capacity=capacity, hint="raise max_num_blocks or the KV memory budget")
        self.max_model_len = min(max_model_len, capacity)
        self.num_blocks, self.block_size = num_blocks, block_size

    def check_request(self, num_prompt_tokens: int, n: int, pooling: int = 0) -> None:
        """The prompt, its samples and their blocks (`check_prompt`, `check_blocks`); an embedding (`pooling`)
        generates nothing, so its prompt may fill max_model_len, and it has one sample."""
        if pooling not in common_pb2.Pooling.values():  # UNSPECIFIED (0): a generation
            raise ValidationError(f"pooling {pooling} is none of LAST, MEAN or CLS")
        if pooling and n != 1:
            raise ValidationError(f"an embedding request has one sample; params.n is {n}")
        self.check_prompt(num_prompt_tokens, generated=0 if pooling else 1)
        self.check_blocks(num_prompt_tokens, n, generated=0 if pooling else 1)

    def check_prompt(self, num_tokens: int, generated: int = 1) -> None:
        """Not empty, and room for the `generated` tokens after it (the first, for a generation)."""
        if not num_tokens:
            raise ValidationError("prompt_token_ids must not be empty")
        if num_tokens + generated > self.max_model_len:
            if not generated:
                raise ValidationError(f"input has {num_tokens} tokens; max_model_len is {self.max_model_len}: "
                                      "shorten the input")
            raise ValidationError(f"prompt has {num_tokens} tokens; max_model_len is {self.max_model_len} "
                                  "and at least one token must be generated: shorten the prompt")

    def check_blocks(self, num_prompt_tokens: int, n: int, generated: int = 1) -> None:
        """Blocks for the prompt and its first token, and one for each other sample's first (copy-on-write)."""
        needed = blocks_for(num_prompt_tokens + generated, self.block_size) + (n - 1)
        if needed > self.num_blocks:
            raise ValidationError(f"prompt needs {needed} KV blocks but the pool has {self.num_blocks}; "
                                  "shorten the prompt, lower n or raise max_num_blocks")
