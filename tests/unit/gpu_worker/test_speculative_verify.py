"""The verification rules of speculative decoding (gpu_worker/sampling/speculative_verify.py).

Greedy: the kept prefix and the target's token. Sampled: a distribution test on a toy target, a Markov chain
over a vocabulary of 3 (the next token's distribution depends on the last token only, so the exact
probability of every 3-token output is known): many seeded generations with a draft model (a second chain),
with a garbage one, and with deterministic proposals, then a chi-square test over the 27 outputs at a fixed
seed. A negative control, keeping every proposal, must fail the same test."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from gpu_worker.sampling.sampler import _seeded_noise
from gpu_worker.sampling.speculative_verify import Verdict, position_noise, verify_greedy, verify_sampled

VOCAB, LENGTH, START, SAMPLES = 3, 3, 0, 6000


def test_greedy_keeps_the_matching_prefix_then_the_targets_token() -> None:
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]) == Verdict([4, 5, 6, 7], 3)
    assert verify_greedy([4, 9, 6, 7], [4, 5, 6]) == Verdict([4, 9], 1)
    assert verify_greedy([1, 5, 6, 7], [4, 5, 6]) == Verdict([1], 0)
    assert verify_greedy([3], []) == Verdict([3], 0)
    with pytest.raises(ValueError, match="2 proposals need 3 target tokens"):
        verify_greedy([1, 2], [1, 2])


def test_without_proposals_a_seeded_draw_is_the_plain_samplers() -> None:
    probs = torch.softmax(torch.randn(1, 50), dim=-1)
    noise = position_noise(50, torch.device("cpu"), seed=7, index=3)
    plain = int(torch.argmax(probs[0] / _seeded_noise(7, 3, 50, torch.device("cpu"))))
    assert verify_sampled(probs, [], None, [noise]).tokens == [plain]
    assert position_noise(50, torch.device("cpu"), seed=7, index=3).uniform == noise.uniform


Proposer = Callable[[int, int, torch.Generator], tuple[list[int], torch.Tensor | None]]


def draft_model(draft: torch.Tensor) -> Proposer:
    """Proposals drawn one after another from a second chain, with the distributions they came from."""
    def propose(last: int, k: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor | None]:
        tokens, rows = [], []
        for _ in range(k):
            rows.append(draft[last])
            last = int(torch.multinomial(draft[last], 1, generator=gen))
            tokens.append(last)
        return tokens, torch.stack(rows) if rows else torch.empty(0, VOCAB)
    return propose


def deterministic(last: int, k: int, gen: torch.Generator) -> tuple[list[int], torch.Tensor | None]:
    """An n-gram-like proposer: a fixed guess from the last token, no distribution."""
    tokens = []
    for _ in range(k):
        last = (last + 1) % VOCAB
        tokens.append(last)
    return tokens, None


def generate(target: torch.Tensor, propose: Proposer, k: int, gen: torch.Generator,
             verify: Callable[..., Verdict] = verify_sampled) -> tuple[int, ...]:
    """LENGTH tokens after START: each step proposes k, scores the k + 1 positions and keeps the verdict."""
    out: list[int] = []
    last = START
    while len(out) < LENGTH:
        proposals, draft_probs = propose(last, k, gen)
        context = [last, *proposals]
        target_probs = target[context]  # position i is scored after the proposals before it
        noise = [position_noise(VOCAB, torch.device("cpu")) for _ in range(k + 1)]
        verdict = verify(target_probs, proposals, draft_probs, noise)
        out.extend(verdict.tokens)
        last = out[-1]
    return tuple(out[:LENGTH])


def chi_square_passes(target: torch.Tensor, samples: Counter) -> bool:
    """Pearson's chi-square of the 27 outputs against the chain's exact probabilities, at p = 0.001 (the critical
    value by Wilson and Hilferty's approximation)."""
    total = sum(samples.values())
    statistic = 0.0
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        p, last = 1.0, START
        for token in seq:
            p, last = p * float(target[last, token]), token
        expected = total * p
        assert expected >= 5, "a cell this rare makes the chi-square unreliable: use larger probabilities"
        statistic += (samples[seq] - expected) ** 2 / expected
    df, z = VOCAB**LENGTH - 1, 3.09
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic < critical


def run(target: torch.Tensor, propose: Proposer, k: int, seed: int, verify: Callable[..., Verdict] = verify_sampled) -> Counter:
    torch.manual_seed(seed)  # the position noises come from torch's global generator
    gen = torch.Generator().manual_seed(seed + 1)
    return Counter(generate(target, propose, k, gen, verify) for _ in range(SAMPLES))


# Row t: the next token's distribution after token t. Every 3-token output has probability >= 0.001 (expected
# counts >= 5 over the samples, as the chi-square needs).
TARGET = torch.tensor([[0.2, 0.5, 0.3], [0.15, 0.25, 0.6], [0.6, 0.3, 0.1]])
DRAFT = torch.tensor([[0.6, 0.2, 0.2], [0.3, 0.3, 0.4], [0.1, 0.1, 0.8]])
GARBAGE = torch.tensor([[0.0, 0.05, 0.95]] * VOCAB)  # proposes what the target rarely wants


@pytest.mark.parametrize(("name", "propose", "k"), [
    ("draft model, k = 2", draft_model(DRAFT), 2),
    ("draft model, k = 3", draft_model(DRAFT), 3),
    ("garbage draft", draft_model(GARBAGE), 2),
    ("the target as its own draft", draft_model(TARGET), 2),
    ("deterministic proposals", deterministic, 2),
])
def test_sampled_outputs_follow_the_targets_distribution(name: str, propose: Proposer, k: int) -> None:
    assert chi_square_passes(TARGET, run(TARGET, propose, k, seed=11)), name


def test_the_chi_square_sees_a_rule_that_keeps_every_proposal() -> None:
    def keep_all(target_probs: torch.Tensor, proposals: list[int], draft_probs: torch.Tensor | None,
                 noise: list) -> Verdict:
        return Verdict([*proposals, int(torch.argmax(target_probs[-1] / noise[-1].exponential))], len(proposals))

    assert chi_square_passes(TARGET, run(TARGET, draft_model(TARGET), 0, seed=11))  # k = 0: plain sampling
    assert not chi_square_passes(TARGET, run(TARGET, draft_model(DRAFT), 2, seed=11, verify=keep_all))


def test_a_draft_equal_to_the_target_keeps_everything() -> None:
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    proposals, draft_probs = draft_model(TARGET)(START, 4, gen)
    target_probs = TARGET[[START, *proposals]]
    noise = [position_noise(VOCAB, torch.device("cpu")) for _ in range(5)]
    assert verify_sampled(target_probs, proposals, draft_probs, noise).accepted == 4


def test_mismatched_shapes_are_refused() -> None:
    noise = [position_noise(VOCAB, torch.device("cpu")) for _ in range(2)]
    with pytest.raises(ValueError, match="1 proposals need 2 target rows"):
        verify_sampled(TARGET[[0]], [1], None, noise)
    with pytest.raises(ValueError, match="need 1 draft rows"):
        verify_sampled(TARGET[[0, 1]], [1], TARGET[[0, 1]], noise)
