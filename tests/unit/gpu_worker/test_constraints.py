"""Constrained decoding, fast: each constraint kind compiles against a real (tiny, trained) tokenizer; bad
ones are ValidationErrors naming their field; the worker's masks on a tiny vocabulary (padding to the
model's width, EOS once complete, replay after preemption, a failing row); the command bridge refuses."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from gateway.backends.bridge_requests import refuse_logits_controls
from gateway.validation import prepare
from gpu_worker.sampling import draft_rows
from gpu_worker.sampling.constrained import GuidanceVocabulary, RowConstraint, build_constraint_masks, unpack_bitmask
from gpu_worker.sampling.sampler import build_sampling_batch, sample
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.constraints import MAX_CONSTRAINT_BYTES, validate_constraint
from hetero_common.errors import ValidationError
from hetero_common.sampling import Sampling, resolve, validate
from hetero_common.tokenizer import load_tokenizer
from hetero_infer.bench.harness import make_tokenizer

EOS = 0  # <|endoftext|> in the tiny tokenizer
MODEL_VOCAB = 512  # the tiny models' logits are wider than their 384-token tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tok")
    make_tokenizer(directory)
    (directory / "config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": 1}))
    return directory


@pytest.fixture(scope="module")
def text_tokenizer(tokenizer_dir: Path):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def vocabulary(text_tokenizer) -> GuidanceVocabulary:
    return GuidanceVocabulary(text_tokenizer.tokenizer.to_str, [EOS], MODEL_VOCAB)


VALID = [
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})),
    ("json_object", True),
    ("regex", r"[a-z]{2,5}\.\d"),
    ("grammar", 'start: "(" item ("," item)* ")"\nitem: /[0-9]/'),
    ("choice", common_pb2.Choices(choices=["yes", "no", "maybe so"])),
]


@pytest.mark.parametrize("kind,value", VALID, ids=[k for k, _ in VALID])
def test_each_kind_compiles_against_the_served_vocabulary(kind, value, text_tokenizer) -> None:
    params = common_pb2.SamplingParams(**{kind: value})
    spec = validate_constraint(params, text_tokenizer.guidance)
    assert spec is not None and spec.kind == kind and resolve(params).constraint == spec
    assert resolve(params).uses_sampler_controls  # the sampler looks at the row


INVALID = [
    ("json_schema", '{"type": "objectx"}', "objectx"),
    ("json_schema", '{"type": ', "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("regex", "[a-z", "unclosed character class"),
    ("regex", "", "must not be empty"),
    ("grammar", "start: foo", "unknown name"),
    ("grammar", 'item: "a"', "no start rule"),
    ("choice", common_pb2.Choices(), "at least one string"),
    ("choice", common_pb2.Choices(choices=["a", ""]), "empty strings"),
    ("regex", "a" * (MAX_CONSTRAINT_BYTES + 1), f"at most {MAX_CONSTRAINT_BYTES}"),
]


@pytest.mark.parametrize("kind,value,words", INVALID, ids=[f"{k}-{w[:12]}" for k, _, w in INVALID])
def test_a_bad_constraint_is_a_validation_error_naming_its_field(kind, value, words, text_tokenizer) -> None:
    request = inference_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(**{kind: value}))
    with pytest.raises(ValidationError) as info:
        prepare(request, text_tokenizer, "m", 512, "r")  # the gateway's check, before anything is queued
    assert info.value.message.startswith(f"params.{kind}") and words in info.value.message
    assert info.value.param == kind


def test_a_constraint_refuses_ignore_eos_and_min_tokens() -> None:
    for extra, name in [({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens")]:
        with pytest.raises(ValidationError, match=f"params.{name} cannot be combined with params.regex"):
            validate(common_pb2.SamplingParams(regex="a+", **extra))
    assert resolve(common_pb2.SamplingParams(json_object=False)).constraint is None  # false asks for nothing


def test_the_command_bridge_refuses_a_constraint() -> None:
    with pytest.raises(ValidationError, match=r"params.json_schema \(constrained decoding\) is not supported by the "
                                              "command bridge") as info:
        refuse_logits_controls(resolve(common_pb2.SamplingParams(json_schema='{"type": "object"}')))
    assert info.value.param == "json_schema"


# --- the worker's masks ---


@dataclass
class Row:
    """What the sampler reads of a worker sequence (gpu_worker.step_io.SequenceState)."""

    sampling: Sampling
    token_ids: list[int]
    num_generated: int = 0
    controls: object = None
    constraint: RowConstraint | None = None


def test_unpack_bitmask_pads_and_truncates_to_the_logits_width() -> None:
    mask = torch.tensor([[0b101, -2**31]], dtype=torch.int32)  # ids 0 and 2; id 63 (the sign bit)
    wide = unpack_bitmask(mask, 70)
    assert wide.shape == (1, 70) and torch.nonzero(wide[0]).flatten().tolist() == [0, 2, 63]
    assert torch.nonzero(unpack_bitmask(mask, 40)[0]).flatten().tolist() == [0, 2]


def choose(rows: list[Row], vocabulary: GuidanceVocabulary, logits: torch.Tensor) -> list[int]:
    """One step of the worker's sampler over `rows`; advances the matchers like the runner does."""
    batch = build_sampling_batch(rows, logits.shape[-1], [EOS], torch.device("cpu"), vocabulary)
    tokens, logprobs = sample(logits, batch)
    token_list = tokens.tolist()
    assert batch.record(token_list) == []
    for row, token in zip(rows, token_list):
        row.token_ids.append(token)
        row.num_generated += 1
    return token_list


def test_masks_follow_the_choice_to_eos_and_leave_other_rows_alone(vocabulary, text_tokenizer) -> None:
    params = common_pb2.SamplingParams(choice=common_pb2.Choices(choices=["yes", "no"]), temperature=0)
    constrained, plain = Row(resolve(params), [1, 5]), Row(resolve(common_pb2.SamplingParams(temperature=0)), [1, 5])
    logits = torch.randn(2, MODEL_VOCAB, generator=torch.Generator().manual_seed(0))
    out: list[int] = []
    for _ in range(8):
        step = logits.clone()
        tokens = choose([constrained, plain], vocabulary, step)
        assert torch.equal(step, logits)  # the model's logits (and so the logprobs) are left as they are
        assert tokens[1] == int(logits[1].argmax())  # the unconstrained greedy row is untouched
        out.append(tokens[0])
        if tokens[0] == EOS:
            break
    assert out[-1] == EOS and text_tokenizer.decode(out[:-1]) in ("yes", "no")
    assert constrained.constraint.matcher.is_stopped()


def test_masks_are_padded_past_the_tokenizer_and_a_replayed_matcher_goes_on(vocabulary, text_tokenizer) -> None:
    params = common_pb2.SamplingParams(regex="[a-z]{6}", temperature=1.0, seed=3)
    row = Row(resolve(params), [1])
    logits = torch.zeros(1, MODEL_VOCAB)
    logits[0, 384:] = 50.0  # ids the tokenizer does not have: the model would pick them, the mask forbids them
    first = choose([row], vocabulary, logits)
    assert first[0] < 384
    # preempted and recomputed: a new worker sequence with prompt + generated ids replays them
    again = Row(resolve(params), list(row.token_ids), row.num_generated)
    while again.token_ids[-1] != EOS:
        choose([again], vocabulary, logits)
        assert len(again.token_ids) < 12
    assert re.fullmatch("[a-z]{6}", text_tokenizer.decode(again.token_ids[1:-1]))


def test_a_matcher_that_fails_fails_its_row_alone(vocabulary) -> None:
    good = Row(resolve(common_pb2.SamplingParams(regex="a+", temperature=0)), [1])
    bad = Row(resolve(common_pb2.SamplingParams(regex="b+", temperature=0)), [1, 400], num_generated=1)  # not replayable
    batch = build_sampling_batch([good, bad], MODEL_VOCAB, [EOS], torch.device("cpu"), vocabulary)
    tokens, _ = sample(torch.zeros(2, MODEL_VOCAB), batch)
    assert [row for row, _ in batch.record(tokens.tolist())] == [1] and "replaying" in bad.constraint.error
    assert not good.constraint.error


def test_a_worker_without_a_tokenizer_fails_constrained_rows_only(tmp_path: Path) -> None:
    def missing() -> str:
        raise FileNotFoundError("no tokenizer.json")

    vocabulary = GuidanceVocabulary(missing, [EOS], MODEL_VOCAB)
    rows = [Row(resolve(common_pb2.SamplingParams(regex="a+")), [1]), Row(resolve(common_pb2.SamplingParams()), [1])]
    masks = build_constraint_masks(rows, [0], MODEL_VOCAB, vocabulary, torch.device("cpu"))
    assert masks is not None and [row for row, _ in masks.advance([3, 4])] == [0] and "no tokenizer.json" in rows[0].constraint.error


def test_the_scheduler_fails_only_the_sample_whose_constraint_failed() -> None:
    from hetero.v1 import worker_pb2
    from tests.helpers.scheduler_driver import make, params

    s = make()
    s.add_request("bad", [1, 1], params(max_tokens=10, regex="a+"))
    s.add_request("good", [1, 1], params(max_tokens=10))
    plan = s.schedule()
    bad, good = plan.scheduled
    result = worker_pb2.StepResult(step_id=plan.step_id, seq_ids=[bad.seq_id, good.seq_id],
                                   token_ids=[0, 7], failures=[worker_pb2.SampleFailure(seq_id=bad.seq_id, error="boom")])
    outs = {o.request_id: o for o in s.process_result(result)}
    assert outs["bad"].finish_reason == common_pb2.FINISH_REASON_ERROR and outs["bad"].error.endswith("boom")
    assert outs["good"].finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and outs["good"].token_ids == [7]
    assert "bad" not in s.requests and bad.seq_id in s.schedule().released_seq_ids


def test_a_model_vocabulary_narrower_than_the_tokenizer_is_served(text_tokenizer) -> None:
    """Ids the logits do not have are cut from the mask; llguidance keeps the tokenizer's own size."""
    vocabulary = GuidanceVocabulary(text_tokenizer.tokenizer.to_str, [EOS], 300)  # the tokenizer has 384
    row = Row(resolve(common_pb2.SamplingParams(choice=common_pb2.Choices(choices=["yes", "no"]), temperature=0)), [1])
    masks = build_constraint_masks([row], [0], 300, vocabulary, torch.device("cpu"))
    assert masks is not None and masks.allowed.shape == (1, 300) and not row.constraint.error
    assert vocabulary.tokenizer.vocab_size == 384 and bool(masks.allowed.any())


# --- drafted rows (speculative decoding: gpu_worker/sampling/draft_rows.py) ---


@dataclass
class DraftedRow(Row):
    """A worker sequence as draft_rows reads it."""

    num_computed: int = 0
    block_table: object = None


def decode_one_at_a_time(params: common_pb2.SamplingParams, vocabulary: GuidanceVocabulary,
                         logits_at: torch.Tensor) -> list[int]:
    row = Row(resolve(params), [1])
    while row.token_ids[-1] != EOS or len(row.token_ids) == 1:
        choose([row], vocabulary, logits_at[row.num_generated][None].clone())
    return row.token_ids[1:]


def decode_with_drafts(params: common_pb2.SamplingParams, vocabulary: GuidanceVocabulary, logits_at: torch.Tensor,
                       reference: list[int], rng: random.Random) -> list[int]:
    """The sample's tokens up to its EOS. Each step proposes up to 4 drafts: the reference's next tokens, some replaced by random ids (most of
    which the grammar refuses); every row's logits are those of the output index it samples."""
    st = DraftedRow(resolve(params), [1], block_table=np.arange(64, dtype=np.int32))
    while EOS not in st.token_ids[1:]:
        drafts = [t if rng.random() < 0.7 else rng.randrange(MODEL_VOCAB)
                  for t in reference[st.num_generated:st.num_generated + rng.randrange(5)]]
        rows = draft_rows.expand([st], [drafts], MODEL_VOCAB, [EOS], torch.device("cpu"), vocabulary)
        batch = build_sampling_batch(rows, MODEL_VOCAB, [EOS], torch.device("cpu"), vocabulary)
        tokens, _ = sample(logits_at[st.num_generated:st.num_generated + len(drafts) + 1].clone(), batch)
        assert batch.record(tokens.tolist()) == []
        st.num_computed = len(st.token_ids) + len(drafts)
        outcome = draft_rows.settle([st], [drafts], [0, len(rows)], tokens.tolist(), block_size=4)
        assert outcome.failures == []
    out = st.token_ids[1:]
    return out[:out.index(EOS) + 1]  # the rows past a kept EOS are sampled unmasked; the scheduler stops there


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_drafted_constrained_rows_give_what_decoding_one_token_at_a_time_gives(temperature, vocabulary,
                                                                              text_tokenizer) -> None:
    """Row j is masked as after d_1..d_j, a refused draft fails nothing, and the matcher keeps only what is
    kept: with the same logits per output index, the outputs are the same tokens."""
    params = common_pb2.SamplingParams(regex=r"[a-z]{2,5}\.\d", temperature=temperature, seed=11)
    logits_at = torch.randn(16, MODEL_VOCAB, generator=torch.Generator().manual_seed(5)) * 4
    reference = decode_one_at_a_time(params, vocabulary, logits_at)
    assert re.fullmatch(r"[a-z]{2,5}\.\d", text_tokenizer.decode(reference[:-1]))
    for seed in range(6):
        assert decode_with_drafts(params, vocabulary, logits_at, reference, random.Random(seed)) == reference
