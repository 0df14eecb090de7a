"""Driving a real Scheduler step by step without a model: `make` one, `params` for a request,
and `answer`, which plays the worker by sampling token 7 for every sequence a plan asks to sample."""

from __future__ import annotations

from hetero.v1 import common_pb2, worker_pb2
from hetero_common.config import Config
from scheduler_svc.core.scheduler import Scheduler

EOS = 2


def make(num_blocks: int = 64, **overrides) -> Scheduler:
    config = Config(**{"block_size": 4, "dtype": "float32", **overrides}).validate()
    return Scheduler(config, num_blocks, (EOS,), max_model_len=config.max_model_len)


def params(max_tokens: int = 4, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def answer(plan: worker_pb2.StepPlan, token: int = 7) -> worker_pb2.StepResult:
    sampled = [s.seq_id for s in plan.scheduled if s.sample]
    return worker_pb2.StepResult(step_id=plan.step_id, seq_ids=sampled, token_ids=[token] * len(sampled))
