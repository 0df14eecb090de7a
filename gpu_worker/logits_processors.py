"""The logits controls of SamplingParams, applied to a step's batch before sampling (vLLM v1's order):

    logit_bias -> min_tokens -> repetition_penalty -> frequency/presence penalties
    (the sampler then applies temperature -> min_p -> top-k/top-p; greedy rows take the argmax here)

Only rows that use a control are touched (gathered, processed, scattered back), so a batch
mixing rows with and without controls shares one step and a step without any pays nothing.

Per-sequence state lives in `RowControls`, built at a sequence's first sampled step from its
token ids and `num_generated` (the worker's view after a recompute preemption or an n > 1 fork is
exactly that: prompt + generated ids, and how many of them were generated). Each control is a
dense [V] tensor on the device, so a step stacks them instead of looping over tokens in Python:
- logit_bias: the bias vector;
- min_tokens: a mask of the ids to hold back (EOS unless ignore_eos, and stop_token_ids);
- penalties: the generated tokens' counts (int32) and a prompt-token mask, updated by one
  indexed add per penalised row after each step (`LogitsControls.record`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hetero_common.sampling import Sampling


@dataclass
class RowControls:
    """One sequence's controls as device tensors (None: that control is off)."""

    bias: torch.Tensor | None = None  # float32 [V]
    hold_back: torch.Tensor | None = None  # bool [V]: ids masked while fewer than min_tokens were generated
    counts: torch.Tensor | None = None  # int32 [V]: times each id was generated
    prompt_mask: torch.Tensor | None = None  # bool [V]: ids in the prompt (repetition penalty)


class ControlledSequence(Protocol):
    """What the worker keeps per sequence (gpu_worker.runner.SequenceState)."""

    sampling: Sampling
    token_ids: list[int]
    num_generated: int
    controls: RowControls | None


def build_row_controls(sampling: Sampling, token_ids: list[int], num_generated: int, vocab_size: int,
                       eos_token_ids: Sequence[int], device: torch.device) -> RowControls:
    """A sequence's controls from its token ids, of which the last `num_generated` were generated."""
    rc = RowControls()
    # The gateway checked the ids against the tokenizer's vocabulary; ids past the model's have no logit.
    bias = {t: b for t, b in sampling.logit_bias.items() if t < vocab_size}
    if bias:
        rc.bias = torch.zeros(vocab_size, dtype=torch.float32)
        rc.bias[list(bias)] = torch.tensor(list(bias.values()), dtype=torch.float32)
        rc.bias = rc.bias.to(device)
    held = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids))
    held = {t for t in held if t < vocab_size}
    if sampling.min_tokens > 0 and held:
        rc.hold_back = torch.zeros(vocab_size, dtype=torch.bool)
        rc.hold_back[sorted(held)] = True
        rc.hold_back = rc.hold_back.to(device)
    if sampling.uses_penalties:
        split = len(token_ids) - num_generated
        ids = torch.tensor(token_ids, dtype=torch.int64)
        rc.counts = torch.bincount(ids[split:], minlength=vocab_size).to(device=device, dtype=torch.int32)
        rc.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool)
        rc.prompt_mask[ids[:split]] = True
        rc.prompt_mask = rc.prompt_mask.to(device)
    return rc


@dataclass
class LogitsControls:
    """One step's controls: `rows` (batch rows with any control) and, per control, the positions
    within `rows` it applies to with the stacked per-row tensors."""

    rows: torch.Tensor  # int64 [R]
    bias_at: torch.Tensor | None = None  # int64 [Rb] (positions in rows)
    bias: torch.Tensor | None = None  # float32 [Rb, V]
    hold_at: torch.Tensor | None = None
    hold_back: torch.Tensor | None = None  # bool [Rh, V]
    penalty_at: torch.Tensor | None = None
    counts: torch.Tensor | None = None  # int32 [Rp, V]
    prompt_mask: torch.Tensor | None = None  # bool [Rp, V]
    frequency: torch.Tensor | None = None  # float32 [Rp]
    presence: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    counted: tuple[tuple[int, torch.Tensor], ...] = ()  # (batch row, that sequence's counts) to update

    def record(self, token_ids: list[int]) -> None:
        """Count the tokens just sampled (rank 0's choice) for the penalised rows."""
        for row, counts in self.counted:
            counts[token_ids[row]] += 1


def build_logits_controls(states: Sequence[ControlledSequence], vocab_size: int, eos_token_ids: Sequence[int],
                          device: torch.device) -> LogitsControls | None:
    """The step's controls, or None when no row uses one (the common case: one pass over the rows)."""
    rows = [i for i, st in enumerate(states) if st.sampling.uses_logits_controls]
    if not rows:
        return None
    bias_at, biases, hold_at, holds, penalty_at, penalised = [], [], [], [], [], []
    for j, i in enumerate(rows):
        st = states[i]
        rc = st.controls
        if rc is None:
            rc = st.controls = build_row_controls(st.sampling, st.token_ids, st.num_generated, vocab_size,
                                                  eos_token_ids, device)
        if rc.bias is not None:
            bias_at.append(j)
            biases.append(rc.bias)
        if rc.hold_back is not None and st.num_generated < st.sampling.min_tokens:
            hold_at.append(j)
            holds.append(rc.hold_back)
        if rc.counts is not None:
            penalty_at.append(j)
            penalised.append((i, st.sampling, rc))

    def index(positions: list[int]) -> torch.Tensor:
        return torch.tensor(positions, dtype=torch.int64).to(device)

    c = LogitsControls(rows=index(rows))
    if biases:
        c.bias_at, c.bias = index(bias_at), torch.stack(biases)
    if holds:
        c.hold_at, c.hold_back = index(hold_at), torch.stack(holds)
    if penalised:
        c.penalty_at = index(penalty_at)
        c.counts = torch.stack([rc.counts for _, _, rc in penalised])
        c.prompt_mask = torch.stack([rc.prompt_mask for _, _, rc in penalised])
        values = torch.tensor([[s.frequency_penalty, s.presence_penalty, s.repetition_penalty] for _, s, _ in penalised],
                              dtype=torch.float32).to(device)
        c.frequency, c.presence, c.repetition = values[:, 0], values[:, 1], values[:, 2]
        c.counted = tuple((i, rc.counts) for i, _, rc in penalised)
    return c


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalties on [P, V] logits with the generated tokens' `counts` and the prompt's tokens.

    Repetition (CTRL; transformers' RepetitionPenaltyLogitsProcessor): a token seen in the prompt
    or the output has a positive logit divided by the penalty, a negative one multiplied.
    Frequency and presence (OpenAI): subtract frequency x count and presence x [count > 0],
    over the generated tokens only."""
    generated = counts > 0
    penalty = torch.where(prompt_mask | generated, repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - frequency[:, None] * counts.to(logits.dtype) - presence[:, None] * generated.to(logits.dtype)


def apply_logits_controls(logits: torch.Tensor, c: LogitsControls) -> torch.Tensor:
    """[B, V] float32 logits -> a new tensor with the controlled rows processed (the input is left as
    it is: the returned logprobs are those of the model's own distribution)."""
    sub = logits.index_select(0, c.rows)
    if c.bias is not None:
        sub.index_add_(0, c.bias_at, c.bias)
    if c.hold_back is not None:
        sub.index_copy_(0, c.hold_at, sub.index_select(0, c.hold_at).masked_fill(c.hold_back, float("-inf")))
    if c.counts is not None:
        penalised = apply_penalties(sub.index_select(0, c.penalty_at), c.counts, c.prompt_mask, c.frequency,
                                    c.presence, c.repetition)
        sub.index_copy_(0, c.penalty_at, penalised)
    return logits.index_copy(0, c.rows, sub)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability (of these logits: after temperature) is below min_p x the row's
    largest; min_p 0 keeps every token."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))
