"""A step reaching past the model's positions is refused on the host, before the model runs: on CUDA the
RoPE table lookup is unchecked, and its device-side assert would end the worker's CUDA context."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_worker.runner import ModelRunner
from hetero.v1 import common_pb2, worker_pb2
from hetero_common.config import Config
from hetero_common.errors import ExecutionError


def _prompt_step(step_id: int, seq_id: int, tokens: int) -> worker_pb2.StepPlan:
    blocks = list(range(4 * seq_id, 4 * seq_id + -(-tokens // 16)))
    return worker_pb2.StepPlan(
        step_id=step_id,
        new_sequences=[worker_pb2.NewSequence(seq_id=seq_id, token_ids=[7] * tokens,
                                              params=common_pb2.SamplingParams(max_tokens=1, temperature=0.0))],
        scheduled=[worker_pb2.ScheduledSequence(seq_id=seq_id, num_tokens=tokens, new_block_ids=blocks, sample=True)])


def test_a_position_past_the_model_is_an_execution_error(tiny_llama_dir: Path) -> None:
    runner = ModelRunner(Config(model=str(tiny_llama_dir), dtype="float32", max_model_len=32).validate())
    assert runner.max_positions == 32
    assert list(runner.execute(_prompt_step(1, 1, 32)).seq_ids) == [1]  # positions 0..31: served
    with pytest.raises(ExecutionError, match="position 39 is beyond the model's 32 positions"):
        runner.execute(_prompt_step(2, 2, 40))
