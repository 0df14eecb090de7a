"""Vectorized sampling across the batch: greedy, temperature, top-k, top-p, per-request seeds,
the logits controls (logit_bias, min_tokens, penalties, min_p: gpu_worker/sampling/logits_processors.py) and
constrained decoding (the token masks of gpu_worker/sampling/constrained.py, after the controls).

Random rows use the exponential-race trick: argmax(p / E) with E ~ Exp(1) draws from p,
so one noise tensor serves the whole batch. A seeded row draws its noise from a generator
seeded by (seed, index of the token being generated): the same seed gives the same output
even if the sequence was preempted and recomputed in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_worker.sampling.constrained import ConstraintMasks, GuidanceVocabulary, build_constraint_masks
from gpu_worker.sampling.logits_processors import (
    ControlledSequence,
    LogitsControls,
    apply_logits_controls,
    apply_min_p,
    build_logits_controls,
)
from kernels.native.argmax import argmax_rows


@dataclass
class SamplingBatch:
    """Per row, as host lists: `sample` knows without a device sync which rows are random and which cut their
    distribution, and a step of greedy rows (the common decode) builds no device tensor for them at all."""

    temperature: list[float]  # per row; 0 = greedy
    top_k: list[int]  # per row; 0 = off
    top_p: list[float]  # per row; 1 = off
    seeds: list[int | None]  # per row
    generated_index: list[int]  # per row: how many tokens the sequence generated before this one
    want_logprobs: bool = False
    controls: LogitsControls | None = None  # None: no row changes its logits before temperature
    min_p: torch.Tensor | None = None  # float32 [B]; None: no row uses min_p
    constraints: ConstraintMasks | None = None  # None: no row is constrained

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of the model's own logits: no random row, nothing changes the logits, no
        logprobs asked for. `sample` then returns `argmax_rows(logits)` and nothing else."""
        return (not any(t > 0 for t in self.temperature) and self.controls is None and self.constraints is None
                and not self.want_logprobs)

    def record(self, token_ids: list[int]) -> list[tuple[int, str]]:
        """After the step: count the sampled tokens of the rows with penalties and advance the constrained
        rows' matchers. Returns (row, error) of the constrained samples that failed."""
        if self.controls is not None:
            self.controls.record(token_ids)
        return self.constraints.advance(token_ids) if self.constraints is not None else []


def build_sampling_batch(states: Sequence[ControlledSequence], vocab_size: int, eos_token_ids: Sequence[int],
                         device: torch.device, vocabulary: GuidanceVocabulary | None = None) -> SamplingBatch:
    """The batch of the sequences sampled this step, in order. `vocabulary`: llguidance's (constrained rows)."""
    samplings = [st.sampling for st in states]
    extra = [i for i, s in enumerate(samplings) if s.uses_sampler_controls]  # usually none: one pass, then nothing
    return SamplingBatch(
        temperature=[s.temperature for s in samplings],
        top_k=[s.top_k for s in samplings],
        top_p=[s.top_p for s in samplings],
        seeds=[s.seed for s in samplings],
        generated_index=[st.num_generated for st in states],
        want_logprobs=any(s.logprobs is not None for s in samplings),
        controls=build_logits_controls(states, extra, vocab_size, eos_token_ids, device) if extra else None,
        min_p=(torch.tensor([s.min_p for s in samplings], dtype=torch.float32, device=device)
               if any(samplings[i].min_p for i in extra) else None),
        constraints=build_constraint_masks(states, extra, vocab_size, vocabulary, device) if extra else None,  # type: ignore[arg-type]
    )


def widest_sampling_batch(rows: int, device: torch.device) -> SamplingBatch:
    """A batch that takes the sampler's largest temporaries: every row random with top-k and top-p (a sort of the
    whole vocabulary per row) and logprobs asked for. The CUDA warm-up samples with it to measure them."""
    return SamplingBatch(temperature=[1.0] * rows, top_k=[50] * rows, top_p=[0.9] * rows, seeds=[None] * rows,
                         generated_index=[0] * rows, want_logprobs=True)


def seeded_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """The generator of a seeded row's draws for the token at `index` of its output."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + index) % (2**63 - 1))
    return gen


def _seeded_noise(seed: int, index: int, vocab: int, device: torch.device) -> torch.Tensor:
    return torch.empty(vocab, device=device).exponential_(generator=seeded_generator(seed, index, device))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, V] float32 -> (token ids [B] int64, chosen-token logprobs [B] or None).

    The logprobs are those of the model's own distribution (`logits` as given), before the logits
    controls, temperature, min_p, top-k and top-p, as vLLM returns them by default."""
    processed = logits if batch.controls is None else apply_logits_controls(logits, batch.controls)
    if batch.constraints is not None:  # after the controls, before temperature, min_p, top-k and top-p
        processed = batch.constraints.apply(processed)
    tokens = argmax_rows(processed)  # greedy rows see bias, penalties and min_tokens too
    rows = [i for i, t in enumerate(batch.temperature) if t > 0]
    if rows:
        device = logits.device
        every_row = len(rows) == logits.shape[0]  # then no gather: the rows are the batch
        index = None if every_row else torch.tensor(rows, device=device)
        temperature = torch.tensor([batch.temperature[i] for i in rows], dtype=torch.float32, device=device)
        scaled = (processed if index is None else processed[index]) / temperature[:, None]
        if batch.min_p is not None:
            scaled = apply_min_p(scaled, batch.min_p if index is None else batch.min_p[index])
        top_k, top_p = [batch.top_k[i] for i in rows], [batch.top_p[i] for i in rows]
        if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
            scaled = _truncate(scaled, torch.tensor(top_k, dtype=torch.int64, device=device),
                               torch.tensor(top_p, dtype=torch.float32, device=device))
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for j, row in enumerate(rows):
            if batch.seeds[row] is not None:
                noise[j] = _seeded_noise(batch.seeds[row], batch.generated_index[row], probs.shape[-1], probs.device)
        drawn = argmax_rows(probs / noise)
        if index is None:
            tokens = drawn
        else:
            tokens[index] = drawn
    logprobs = None
    if batch.want_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


def top_logprobs(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n most likely tokens per row, best first: (token ids [B, n] int64, logprobs [B, n]).

    Like the chosen token's logprob, these are the model's distribution before temperature,
    top-k and top-p. Only sampled positions reach here (the runner computes no other logits).
    """
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(n, logits.shape[-1]), dim=-1)
    return ids, values


def _truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf (one sort for both)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    drop = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the mass before it already reaches top_p; the first token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
