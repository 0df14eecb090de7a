"""The contract: generated stubs match protos/, and the messages keep the promised shape."""

from __future__ import annotations

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.protogen import stale_files
from hetero_common.sampling import resolve


def test_generated_stubs_are_up_to_date() -> None:
    assert stale_files() == [], "run `python -m hetero_infer.protogen` and commit the result"


def test_zero_is_not_the_default() -> None:
    unset = resolve(common_pb2.SamplingParams())
    assert (unset.temperature, unset.top_p, unset.max_tokens, unset.seed) == (1.0, 1.0, 100, None)
    greedy = resolve(common_pb2.SamplingParams(temperature=0.0, seed=0))
    assert greedy.temperature == 0.0 and greedy.seed == 0


def test_prompt_is_one_of_text_ids_or_chat() -> None:
    request = inference_pb2.GenerateRequest(prompt="hi")
    request.prompt_token_ids.ids.append(5)
    assert request.WhichOneof("input") == "prompt_token_ids"
    names = {v.name for v in common_pb2.FinishReason.DESCRIPTOR.values}
    assert {"FINISH_REASON_STOP", "FINISH_REASON_LENGTH", "FINISH_REASON_ABORT", "FINISH_REASON_ERROR"} <= names
