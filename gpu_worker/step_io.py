"""What the model runner keeps and passes around: the worker's state of one sequence (`SequenceState`, updated
from the plans' diffs), one step's model inputs flattened over its sequences (`StepInputs`, built by
ModelRunner._prepare), its samples (`SampledTokens`), and how those go into the StepResult (`pack_samples`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_worker.pooling import PoolingEntry
from gpu_worker.sampling import draft_rows
from gpu_worker.sampling.constrained import RowConstraint
from gpu_worker.sampling.logits_processors import RowControls
from gpu_worker.sampling.prompt_logprobs import PromptSpan
from gpu_worker.sampling.sampler import top_logprobs
from hetero.v1 import worker_pb2
from hetero_common.sampling import Sampling
from kernels.page_table import PageTable


@dataclass
class SequenceState:
    token_ids: list[int]
    sampling: Sampling
    num_generated: int
    block_table: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    num_computed: int = -1  # tokens whose K/V is in the cache; -1: new, take the plan's count (prefix-cache hits)
    prompt_logprobs: int | None = None  # alternatives per prompt position to score (gpu_worker/sampling/prompt_logprobs.py)
    controls: RowControls | None = None  # logits controls' state, built at the first sampled step (logits_processors)
    constraint: RowConstraint | None = None  # the constraint's matcher, built at the first sampled step (constrained)
    draft_computed: int = 0  # tokens whose draft-model K/V is cached (draft_model.py)
    lora_slot: int = 0  # its LoRA adapter's slot (lora_slots.py); 0: the base model
    pooling: int = 0  # an embedding sequence's common_pb2.Pooling (pooling.py); 0: it samples
    pooled: torch.Tensor | None = None  # its pooled rows so far (pooling.py)


@dataclass
class StepInputs:
    """One step's model inputs, flattened over its scheduled sequences (ModelRunner._prepare)."""

    states: list[SequenceState]  # in the plan's order
    qo_lens: list[int]  # tokens each computes this step
    spans: list[PromptSpan]  # prompt positions whose logprobs are asked for
    table: PageTable
    positions: np.ndarray  # int64 [T]: each token's position in its sequence
    slots: np.ndarray  # int64 [T]: where each token's K/V is written
    flat_inputs: np.ndarray  # int64 [T]: the token ids
    sample_idx: list[int]  # the scheduled sequences that sample, by index
    logits_rows: torch.Tensor  # int64: their last rows in the flattened tokens (a drafted one's last k + 1)
    drafts: list[list[int]] | None = None  # per sampling sequence, its speculative drafts; None: none in the step
    row_starts: list[int] | None = None  # with drafts: where each sampling sequence's rows start (draft_rows.py)
    draft_seconds: tuple[float, float] = (0.0, 0.0)  # the draft model's: in all, proposing alone (draft_model.py)
    pooled: list[PoolingEntry] = field(default_factory=list)  # the embedding sequences' shares (pooling.py)
    graph_greedy: torch.Tensor | None = None  # a graph step's greedy tokens, one per sampling sequence (cuda_graphs)


@dataclass
class SampledTokens:
    """The step's samples (ModelRunner._sample), in `StepInputs.sample_idx` order."""

    states: list[SequenceState]
    token_ids: list[int]
    logprobs: torch.Tensor | None  # the sampled tokens' own, where asked for
    failures: list[tuple[int, str]]  # (row, error) of the constrained samples that failed
    drafted: draft_rows.DraftOutcome | None = None  # with drafts: the drafts kept, the rows the tokens came from


def pack_samples(plan: worker_pb2.StepPlan, step: StepInputs, sampled: SampledTokens, logits: torch.Tensor,
                 result: worker_pb2.StepResult) -> None:
    """The sampled tokens into `result`: their sequences, failed constraints, logprobs and top alternatives."""
    for row, error in sampled.failures:
        result.failures.add(seq_id=plan.scheduled[step.sample_idx[row]].seq_id, error=error)
    result.seq_ids.extend(plan.scheduled[i].seq_id for i in step.sample_idx)
    result.token_ids.extend(sampled.token_ids)
    num_top, logprobs = max(st.sampling.logprobs or 0 for st in sampled.states), sampled.logprobs
    if sampled.drafted is not None:  # the kept drafts' scores apart, then the rows of the tokens after them
        draft_rows.pack(result, sampled.drafted, logits, logprobs, num_top)
        logits = logits[sampled.drafted.rows]
        logprobs = None if logprobs is None else logprobs[sampled.drafted.rows]
    if logprobs is not None:
        result.logprobs.extend(logprobs.tolist())
    if num_top:
        top_ids, top_values = top_logprobs(logits, num_top)
        result.num_top_logprobs = top_ids.shape[1]
        result.top_token_ids.extend(top_ids.flatten().tolist())
        result.top_logprobs.extend(top_values.flatten().tolist())
