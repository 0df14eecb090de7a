"""Verification of speculative proposals (issue 40): which of k proposed tokens a sequence keeps, and the one
token of the target's own that follows them, from the target's scores at the k + 1 positions (position i
scored with the proposals before i in its context). Not wired into the engine step yet.

- Greedy: the longest prefix of the proposals equal to the target's choices, then the target's choice at
  the first mismatch (or after the last proposal). The output is exactly what decoding without
  speculation gives.
- Sampled: the rejection rule of Leviathan et al. (2023) and Chen et al. (2023). Proposal x at position i,
  drawn from the proposer's q_i, is kept with probability min(1, p_i(x) / q_i(x)); at the first one
  rejected, the token is drawn from max(0, p_i - q_i) renormalised, and when all are kept, from p_k. Every
  emitted token is then distributed exactly as sampling from the target alone would give. A deterministic
  proposer (n-gram lookup) has q_i one-hot at its proposal: x is kept with probability p_i(x), and a
  rejection draws from p_i without x.

Draws use the sampler's exponential race (argmax(r / E) with E ~ Exp(1) draws from r, normalised or not).
A seeded row draws position i's noise from the sampler's generator for that output index, the exponentials
first and then the acceptance test's uniform: with no proposals this is the plain sampler's draw, bit for
bit, and a recompute after preemption draws the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_worker.sampling.sampler import seeded_generator


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # the kept proposals, then the target's own token: 1 to k + 1 tokens
    accepted: int  # how many proposals were kept


@dataclass(frozen=True)
class PositionNoise:
    exponential: torch.Tensor  # [V] float32: the exponential race's noise for a token drawn at this position
    uniform: float  # in [0, 1): the acceptance test's draw


def verify_greedy(target_tokens: Sequence[int], proposals: Sequence[int]) -> Verdict:
    """target_tokens: the target's choice at each of the k + 1 positions."""
    if len(target_tokens) != len(proposals) + 1:
        raise ValueError(f"{len(proposals)} proposals need {len(proposals) + 1} target tokens, got {len(target_tokens)}")
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == target_tokens[accepted]:
        accepted += 1
    return Verdict([*proposals[:accepted], int(target_tokens[accepted])], accepted)


def position_noise(vocab: int, device: torch.device, seed: int | None = None, index: int = 0) -> PositionNoise:
    """One position's draws: from the row's seeded generator for output index `index`, or torch's global one."""
    generator = seeded_generator(seed, index, device) if seed is not None else None
    exponential = torch.empty(vocab, device=device).exponential_(generator=generator)
    uniform = float(torch.rand(1, device=device, generator=generator))
    return PositionNoise(exponential, uniform)


def verify_sampled(target_probs: torch.Tensor, proposals: Sequence[int], draft_probs: torch.Tensor | None,
                   noise: Sequence[PositionNoise]) -> Verdict:
    """target_probs [k + 1, V]: the target's distribution at each position, after every logits control,
    temperature, min_p, top-k and top-p; draft_probs [k, V]: the distributions the proposals were drawn from,
    or None for a deterministic proposer; noise: k + 1 positions' draws."""
    k = len(proposals)
    if target_probs.shape[0] != k + 1 or len(noise) != k + 1:
        raise ValueError(f"{k} proposals need {k + 1} target rows and noises, got {target_probs.shape[0]} and {len(noise)}")
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"{k} proposals need {k} draft rows, got {draft_probs.shape[0]}")
    for i, token in enumerate(proposals):
        p = target_probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if noise[i].uniform * q_token < float(p[token]):  # u < p / q, without dividing by a q of 0
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        if not bool((residual > 0).any()):  # p equals q up to rounding: a rejection cannot have happened
            residual = p
        return Verdict([*proposals[:i], int(torch.argmax(residual / noise[i].exponential))], i)
    return Verdict([*proposals, int(torch.argmax(target_probs[k] / noise[k].exponential))], k)
