"""Prompt logprobs (SamplingParams.prompt_logprobs): the model's logprob of each prompt token
given the ones before it, scored from the hidden states of the prompt positions a step computes.

A chunk computing prompt positions [a, b) of a prompt of length L scores prompt tokens
a+1 .. min(b, L-1): the logits at position p predict token p+1, and the last position's
logits predict the first generated token instead (that is sampling's business). With chunked
prefill a prompt arrives over several steps; each step returns its own entry and the scheduler
puts them together by position. A sequence re-sent after a recompute preemption with tokens
already generated scores nothing: its prompt logprobs were delivered with its first token.

Memory: a long chunk's logits are rows x vocab floats, so the LM head and log_softmax run over
at most `ROWS_PER_PASS` rows at a time; only the chosen and top-k values are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hetero.v1 import common_pb2, worker_pb2


class LogitsHead(Protocol):
    """What scoring needs of the model (`gpu_worker.models.model.LlamaModel`; named by its shape, since the
    model's room builds on this one): its output projection and the logits of final-norm rows."""

    lm_head: torch.Tensor

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


ROWS_PER_PASS = 256  # logits rows alive at once: 256 x 49,152 floats is 48 MiB for SmolLM2's vocabulary


def wanted(params: common_pb2.SamplingParams, num_generated: int) -> int | None:
    """Alternatives per prompt position a newly sent sequence asks for; None: it scores no prompt token."""
    if not params.HasField("prompt_logprobs") or num_generated > 0:
        return None
    return params.prompt_logprobs


@dataclass
class PromptSpan:
    """Prompt positions of one sequence whose logits this step scores."""

    seq_id: int
    first_row: int  # row in the step's flattened tokens of the first scored position
    first_position: int  # prompt position of the first scored token (the position after the row's)
    targets: list[int]  # the prompt tokens scored, in order
    num_top: int


def prompt_span(seq_id: int, num_top: int | None, token_ids: list[int], num_generated: int, num_computed: int,
                num_tokens: int, first_row: int) -> PromptSpan | None:
    """The span a chunk of `num_tokens` from `num_computed` on scores (None: none).

    `token_ids` and `num_generated` are the worker's for the sequence before this step samples."""
    if num_top is None:
        return None
    prompt_len = len(token_ids) - num_generated
    end = min(num_computed + num_tokens, prompt_len - 1)  # the last prompt position scores no prompt token
    if end <= num_computed:
        return None
    return PromptSpan(seq_id, first_row, num_computed + 1, token_ids[num_computed + 1:end + 1], num_top)


def score(model: LogitsHead, hidden: torch.Tensor, spans: list[PromptSpan]) -> list[worker_pb2.PromptLogprobs]:
    """Each span's entry: float32 log_softmax of the raw logits at its rows, the prompt token's
    value and the `num_top` best alternatives (best first)."""
    entries = []
    for span in spans:
        entry = worker_pb2.PromptLogprobs(seq_id=span.seq_id, first_position=span.first_position)
        count = len(span.targets)
        targets = torch.tensor(span.targets, dtype=torch.int64, device=hidden.device)
        k = min(span.num_top, model.lm_head.shape[0])
        entry.num_top = k
        for start in range(0, count, ROWS_PER_PASS):
            stop = min(count, start + ROWS_PER_PASS)
            rows = hidden[span.first_row + start:span.first_row + stop]
            logprobs = torch.log_softmax(model.logits(rows), dim=-1)
            entry.logprobs.extend(logprobs.gather(1, targets[start:stop, None]).squeeze(1).tolist())
            if k:
                values, ids = logprobs.topk(k, dim=-1)
                entry.top_token_ids.extend(ids.flatten().tolist())
                entry.top_logprobs.extend(values.flatten().tolist())
        entries.append(entry)
    return entries
