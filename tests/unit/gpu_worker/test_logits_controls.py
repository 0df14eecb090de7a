"""The logits controls (frequency/presence/repetition penalties, min_p, logit_bias, min_tokens) on
hand-built logits, their validation, and min_tokens in the scheduler's finish check and the
gateway's stop strings. Model runs: tests/model/test_sampling_controls_model.py."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gateway.backends.bridge_requests import refuse_logits_controls
from gateway.text.text_stream import TextStream
from gpu_worker.sampling.logits_processors import RowControls, apply_min_p
from gpu_worker.sampling.sampler import build_sampling_batch, sample
from hetero.v1 import common_pb2
from hetero_common.errors import ValidationError
from hetero_common.sampling import Sampling, resolve, validate
from hetero_common.tokenizer import load_tokenizer
from scheduler_svc.sequence import Sequence
from scheduler_svc.core.token_output import finish_reason

V = 12
EOS = (0,)
CPU = torch.device("cpu")


@dataclass
class Row:
    """The worker's per-sequence state as the sampler reads it (gpu_worker.step_io.SequenceState)."""

    sampling: Sampling
    token_ids: list[int]
    num_generated: int
    controls: RowControls | None = None


def row(token_ids: list[int], num_generated: int, **params) -> Row:
    return Row(resolve(common_pb2.SamplingParams(**{"temperature": 0.0, **params})), list(token_ids), num_generated)


def processed(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The logits the sampler picks from (before temperature): the greedy pick is their argmax."""
    from gpu_worker.sampling.logits_processors import apply_logits_controls

    batch = build_sampling_batch(rows, logits.shape[-1], EOS, CPU)
    return logits if batch.controls is None else apply_logits_controls(logits, batch.controls)


def test_frequency_and_presence_penalties_match_their_definition() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    prompt, generated = [5, 6, 7], [3, 3, 3, 9, 5]  # 5 is in both; 6 and 7 only in the prompt
    rows = [row(prompt + generated, len(generated), frequency_penalty=0.7),
            row(prompt + generated, len(generated), presence_penalty=-1.5),
            row(prompt + generated, len(generated), frequency_penalty=2.0, presence_penalty=0.25)]
    out = processed(logits, rows)
    counts = torch.zeros(V)
    for t in generated:  # over the generated tokens only, never the prompt's
        counts[t] += 1
    for i, (f, p) in enumerate([(0.7, 0.0), (0.0, -1.5), (2.0, 0.25)]):
        expected = logits[i] - f * counts - p * (counts > 0).float()
        assert torch.allclose(out[i], expected, atol=1e-6), i
    assert out[0, 3] == pytest.approx(float(logits[0, 3]) - 0.7 * 3)
    assert out[0, 6] == logits[0, 6]  # prompt-only token: untouched by frequency/presence


def test_repetition_penalty_equals_transformers_processor() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(1)
    logits = torch.randn(4, V) * 4
    sequences = [[1, 2, 3, 3, 4], [11, 0, 5], [7], [2, 2, 2, 9, 10, 8]]
    generated = [2, 1, 0, 3]
    for penalty in (1.3, 0.7, 2.0):
        ours = processed(logits, [row(ids, g, repetition_penalty=penalty) for ids, g in zip(sequences, generated)])
        for i, ids in enumerate(sequences):
            theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[i:i + 1].clone())
            assert torch.allclose(ours[i], theirs[0], atol=1e-6), (penalty, i)


def test_min_p_keeps_exactly_the_tokens_above_the_threshold() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.12, 0.1, 0.05, 0.03], [0.4, 0.3, 0.12, 0.1, 0.05, 0.03]]))
    out = apply_min_p(logits, torch.tensor([0.25, 0.0]))
    assert torch.isfinite(out[0]).tolist() == [True, True, True, True, False, False]  # >= 0.25 x 0.4 = 0.1
    assert torch.equal(out[1], logits[1])  # min_p 0: every token stays
    # Through the sampler: a random row with min_p draws only from the kept set.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = [Row(resolve(common_pb2.SamplingParams(temperature=1.0, min_p=0.2)), [1], 0) for _ in range(3000)]
    tokens = sample(torch.log(probs).repeat(3000, 1), build_sampling_batch(rows, 4, EOS, CPU))[0]
    assert set(tokens.tolist()) == {0, 1, 2}  # 0.05 < 0.2 x 0.5


def test_logit_bias_forces_and_bans_tokens_greedy_and_random() -> None:
    torch.manual_seed(2)
    logits = torch.randn(400, V)
    force = [row([1, 2], 0, logit_bias={7: 100.0}), row([1, 2], 0, temperature=1.0, logit_bias={7: 100.0})] * 200
    tokens = sample(logits, build_sampling_batch(force, V, EOS, CPU))[0]
    assert set(tokens.tolist()) == {7}
    best = logits.argmax(-1)
    ban = [Row(resolve(common_pb2.SamplingParams(temperature=t, logit_bias={int(b): -100.0})), [1], 0)
           for t, b in zip([0.0, 1.0] * 200, best)]
    batch = build_sampling_batch(ban, V, EOS, CPU)
    tokens, logprobs = sample(logits, batch)
    assert not (tokens == best).any()
    assert torch.equal(tokens[::2], logits.scatter(1, best[:, None], -1e9).argmax(-1)[::2])  # greedy: the runner-up


def test_min_tokens_masks_eos_and_stop_ids_only_below_the_threshold() -> None:
    logits = torch.zeros(4, V)
    logits[:, 0] = 10.0  # EOS is by far the likeliest
    logits[:, 4] = 9.0  # then a stop token id
    rows = [row([1, 2], 0, min_tokens=3, stop_token_ids=[4]),  # 0 generated < 3: both held back
            row([1, 2, 5, 5], 2, min_tokens=3, stop_token_ids=[4]),  # 2 < 3: held back
            row([1, 2, 5, 5, 5], 3, min_tokens=3, stop_token_ids=[4]),  # 3 generated: free again
            row([1, 2], 0, min_tokens=3, ignore_eos=True)]  # EOS held back all the same (vLLM)
    out = processed(logits, rows)
    assert out[0, 0] == out[0, 4] == out[1, 0] == out[1, 4] == out[3, 0] == -math.inf
    assert torch.isfinite(out[0, 1:4]).all() and torch.isfinite(out[0, 5:]).all()
    assert torch.equal(out[2], logits[2]) and torch.isfinite(out[3, 1:]).all()
    assert sample(logits, build_sampling_batch(rows, V, EOS, CPU))[0].tolist() == [1, 1, 0, 4]


def test_a_mixed_batch_gives_each_row_what_it_gives_alone() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, 50) * 2
    rows = [row(list(range(10)), 4, repetition_penalty=1.3, frequency_penalty=0.5),
            row([3, 4], 0),
            row([5, 6, 7], 1, temperature=0.9, seed=11, presence_penalty=1.0, min_p=0.05, logit_bias={3: 2.0}),
            row([5, 6, 7], 1, temperature=0.9, seed=12, top_p=0.8),
            row([1, 2], 0, temperature=1.0, seed=13, min_tokens=2, top_k=5),
            row([8], 0, temperature=1.0, seed=14)]
    batch = build_sampling_batch(rows, 50, EOS, CPU)
    batch.want_logprobs = True
    together, logprobs = sample(logits, batch)
    for i, r in enumerate(rows):
        alone = Row(r.sampling, r.token_ids, r.num_generated)
        assert sample(logits[i:i + 1], build_sampling_batch([alone], 50, EOS, CPU))[0].item() == together[i].item(), i
    # The logprobs are the model's own distribution, before any control.
    raw = torch.log_softmax(logits, -1).gather(1, together[:, None]).squeeze(1)
    assert torch.allclose(logprobs, raw)


def test_counts_follow_the_sampled_tokens_and_a_plain_step_builds_nothing() -> None:
    penalised = row([1, 2, 3], 1, frequency_penalty=1.0)
    batch = build_sampling_batch([row([4], 0), penalised], V, EOS, CPU)
    batch.record([6, 9])
    assert penalised.controls is not None and penalised.controls.counts.tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0]
    plain = build_sampling_batch([row([4], 0), row([5], 0, temperature=1.0, top_p=0.5)], V, EOS, CPU)
    assert plain.controls is None and plain.min_p is None


BAD_CONTROLS = [
    ("frequency_penalty", dict(frequency_penalty=2.5)), ("frequency_penalty", dict(frequency_penalty=float("nan"))),
    ("presence_penalty", dict(presence_penalty=-2.01)), ("presence_penalty", dict(presence_penalty=float("inf"))),
    ("repetition_penalty", dict(repetition_penalty=0.0)), ("repetition_penalty", dict(repetition_penalty=2.5)),
    ("repetition_penalty", dict(repetition_penalty=float("-inf"))), ("min_p", dict(min_p=1.5)),
    ("min_p", dict(min_p=-0.1)), ("min_p", dict(min_p=float("nan"))), ("min_tokens", dict(min_tokens=101)),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)), ("logit_bias", dict(logit_bias={V: 1.0})),
    ("logit_bias", dict(logit_bias={3: 100.5})), ("logit_bias", dict(logit_bias={3: float("nan")})),
    ("logit_bias", dict(logit_bias={i: 1.0 for i in range(1025)})), ("prompt_logprobs", dict(prompt_logprobs=21)),
]


@pytest.mark.parametrize("name, params", BAD_CONTROLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_CONTROLS)])
def test_bad_controls_are_refused_naming_the_field(name: str, params: dict) -> None:
    vocab = 2000 if name == "logit_bias" and len(params["logit_bias"]) > 1 else V
    with pytest.raises(ValidationError, match=f"params.{name}"):
        validate(common_pb2.SamplingParams(**params), vocab)


def test_edge_values_are_accepted() -> None:
    s = validate(common_pb2.SamplingParams(frequency_penalty=-2, presence_penalty=2, repetition_penalty=2, min_p=1,
                                           min_tokens=100, logit_bias={V - 1: -100, 0: 100}, prompt_logprobs=20), V)
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty, s.min_p, s.min_tokens) == (-2, 2, 2, 1, 100)
    off = validate(common_pb2.SamplingParams(), V)
    assert (off.frequency_penalty, off.presence_penalty, off.repetition_penalty, off.min_p, off.min_tokens,
            off.logit_bias) == (0, 0, 1, 0, 0, {})
    assert not off.uses_logits_controls


def test_the_command_bridge_refuses_every_control() -> None:
    refuse_logits_controls(resolve(common_pb2.SamplingParams(frequency_penalty=0, repetition_penalty=1)))  # defaults
    for name, value in [("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("repetition_penalty", 1.2),
                        ("min_p", 0.1), ("min_tokens", 3), ("logit_bias", {5: 1.0})]:
        with pytest.raises(ValidationError, match=f"params.{name} is not supported by the command bridge"):
            refuse_logits_controls(resolve(common_pb2.SamplingParams(**{name: value})))


def test_finish_check_holds_eos_and_stop_ids_until_min_tokens() -> None:
    sampling = resolve(common_pb2.SamplingParams(min_tokens=2, stop_token_ids=[4]))
    seq = Sequence.new(1, "r", [9, 9], 2, sampling, common_pb2.SamplingParams())
    for token, expected in [(0, 0), (4, 0), (0, common_pb2.FINISH_REASON_STOP)]:
        seq.token_ids.append(token)  # the scheduler appends, then asks
        assert finish_reason(seq, token, frozenset(EOS), 512) == expected


def test_stop_strings_are_looked_for_only_after_min_tokens(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    ids = tokenizer.encode("The quick brown fox. The lazy dog.", add_special_tokens=False)
    prompt = tokenizer.encode("Paris", add_special_tokens=False)
    first_the_tokens = len(tokenizer.encode("The", add_special_tokens=False))

    def stream(min_tokens: int) -> tuple[str, bool]:
        text_stream = TextStream(tokenizer, prompt, resolve(common_pb2.SamplingParams(stop=["The"], min_tokens=min_tokens)))
        texts, stopped = [], False
        for i in range(0, len(ids), 2):  # pushes of two tokens: min_tokens may fall inside one
            delta = text_stream.push(ids[i:i + 2])
            texts.append(delta.text)
            if delta.stopped:
                stopped = True
                break
        if not stopped:
            texts.append(text_stream.finish())
        return "".join(texts), stopped

    assert stream(0) == ("", True)
    text, stopped = stream(first_the_tokens + 1)  # the first "The" is inside min_tokens: the second one stops
    assert stopped and text == "The quick brown fox. "
    assert stream(len(ids)) == ("The quick brown fox. The lazy dog.", False)
