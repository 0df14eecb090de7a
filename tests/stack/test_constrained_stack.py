"""Constrained decoding through the real three-process stack over gRPC, on the tiny random model at
temperature 1: every sample of five JSON Schemas validates (jsonschema), regex samples fully match,
choice samples are in their set, Lark-grammar samples parse; bad constraints are INVALID_ARGUMENT naming
the field; constrained rows stay valid under preemption (recompute and swap, a pool too small for the
batch), with n = 3 and with prefix-cache hits, while unconstrained greedy rows in the same steps stay
token-exact against transformers; tensor parallelism 2 follows rank 0's tokens."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import jsonschema
import pytest

from hetero.v1 import common_pb2, inference_pb2
from tests.helpers.oracle import NEW_TOKENS, hf_greedy, make_prompts
from hetero_infer.bench.harness import Stack, pool, run_stack, wait_for_idle
from tests.helpers.stack_requests import ids_request

pytestmark = pytest.mark.slow

NAME = {"type": "string", "maxLength": 8}
SCHEMAS = {
    "nested_objects": {
        "type": "object", "additionalProperties": False, "required": ["name", "address"],
        "properties": {"name": NAME, "address": {
            "type": "object", "additionalProperties": False, "required": ["city", "zip"],
            "properties": {"city": {"enum": ["Paris", "Berlin", "Tokyo"]},
                           "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}}}}},
    "bounded_array": {
        "type": "object", "additionalProperties": False, "required": ["tags"],
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1,
                                "maxItems": 3}}},
    "enums": {
        "type": "object", "additionalProperties": False, "required": ["color", "size", "ok"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
                       "ok": {"type": "boolean"}}},
    "number_ranges": {
        "type": "object", "additionalProperties": False, "required": ["age", "level", "ratio"],
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "level": {"type": "integer", "minimum": -5, "maximum": 5},
                       "ratio": {"type": "number", "minimum": -1.5, "maximum": 2.5}}},
    "required_and_optional": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False, "required": ["id", "done"],
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "note": NAME,
                           "done": {"type": "boolean"}}}},
}
REGEXES = [r"[A-Z][a-z]{2,6} [0-9]{1,3}", r"(cat|dog|bird)s?", r"[0-9]{3}-[0-9]{4}"]  # Rust regex: \\d is any Unicode digit
CHOICES = ["red", "green", "blue sky", "yes/no"]
GRAMMAR = 'start: "[" num ("," num){0,3} "]"\nnum: /[0-9]{1,2}/'  # a list of 1-4 small numbers
GRAMMAR_RE = r"\[\d{1,2}(,\d{1,2}){0,3}\]"
PROMPT = make_prompts()[3]  # 9 random token ids
SAMPLES, N = 50, 10  # 50 samples per constraint: 5 requests of n = 10


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path):
    with run_stack(tiny_llama_dir, "--block-size", "4", "--max-model-len", "512") as s:
        yield s


def request(seed: int, n: int = N, max_tokens: int = 120, prompt: list[int] = PROMPT, **constraint
            ) -> inference_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, **constraint)
    return inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=prompt), params=params)


def samples(stack: Stack, requests: list[inference_pb2.GenerateRequest]) -> list[str]:
    """Every sample's text; each must have ended with EOS (the constraint complete), not max_tokens."""
    with ThreadPoolExecutor(len(requests)) as pool_:
        answers = list(pool_.map(lambda r: stack.inference.Complete(r, timeout=300), requests))
    texts = []
    for answer in answers:
        for choice in answer.choices:
            assert choice.finish_reason == common_pb2.FINISH_REASON_STOP, (choice.text, choice.finish_reason)
            texts.append(choice.text)
    return texts


def seeded(count: int, **constraint) -> list[inference_pb2.GenerateRequest]:
    return [request(seed=100 + i, **constraint) for i in range(count // N)]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_samples_validate(stack: Stack, name: str) -> None:
    schema = SCHEMAS[name]
    texts = samples(stack, seeded(SAMPLES, json_schema=json.dumps(schema)))
    assert len(texts) == SAMPLES and len(set(texts)) > 1  # temperature 1: random, and still valid
    for text in texts:
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)), text  # compact: no whitespace outside strings
        jsonschema.validate(json.loads(text), schema)
    if name == "number_ranges":  # fractions and exponents are drawn too, inside the range
        assert any(isinstance(json.loads(t)["ratio"], float) for t in texts), texts


def test_regex_choice_grammar_and_json_object_samples_match(stack: Stack) -> None:
    for pattern in REGEXES:
        texts = samples(stack, seeded(SAMPLES, regex=pattern))
        assert len(texts) == SAMPLES and all(re.fullmatch(pattern, t) for t in texts), texts
    texts = samples(stack, seeded(SAMPLES, choice=common_pb2.Choices(choices=CHOICES)))
    assert len(texts) == SAMPLES and set(texts) <= set(CHOICES) and len(set(texts)) > 1
    texts = samples(stack, seeded(20, grammar=GRAMMAR))
    assert all(re.fullmatch(GRAMMAR_RE, t) for t in texts), texts
    # Any JSON object: keys and strings are unbounded, so a random model rarely closes one; a bias towards
    # '"' and '}' (inside the constraint: the mask still decides what may come) makes the objects end.
    bias = {}
    for text in ('"', "}"):
        ids = stack.inference.Tokenize(inference_pb2.TokenizeRequest(text=text, add_special_tokens=False)).token_ids
        bias[ids[0]] = 4.0
    objects = request(seed=7, n=10, max_tokens=300, json_object=True)
    objects.params.logit_bias.update(bias)
    texts = samples(stack, [objects])
    assert all(isinstance(json.loads(t), dict) for t in texts) and len(set(texts)) > 1, texts


def test_greedy_constrained_output_is_the_same_on_a_prefix_cache_hit(stack: Stack) -> None:
    prompt = make_prompts()[-1]  # 50 tokens: 12 full blocks of 4
    schema = json.dumps(SCHEMAS["enums"])
    first, second = (stack.inference.Complete(request(seed=1, n=1, prompt=prompt, json_schema=schema)) for _ in range(2))
    greedy = request(seed=1, n=1, prompt=prompt, json_schema=schema)
    greedy.params.temperature = 0.0
    third, fourth = (stack.inference.Complete(greedy) for _ in range(2))
    assert second.usage.cached_prompt_tokens == fourth.usage.cached_prompt_tokens == 48
    assert first.text == second.text and third.text == fourth.text  # seeded and greedy: the cache changes nothing
    jsonschema.validate(json.loads(third.text), SCHEMAS["enums"])


BAD = [("json_schema", '{"type": "objectx"}'), ("json_schema", "{not json"), ("regex", "(unclosed"),
       ("grammar", "start: undefined_rule"), ("choice", common_pb2.Choices())]


@pytest.mark.parametrize("kind,value", BAD, ids=[f"{k}{i}" for i, (k, _) in enumerate(BAD)])
def test_a_bad_constraint_is_invalid_argument_naming_the_field(stack: Stack, kind: str, value) -> None:
    bad = inference_pb2.GenerateRequest(prompt="hello", params=common_pb2.SamplingParams(**{kind: value}))
    for call in (stack.inference.Complete, lambda r: list(stack.inference.Generate(r))):
        with pytest.raises(grpc.RpcError) as info:
            call(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"params.{kind}"), info.value.details()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_rows_under_preemption_with_n3_beside_exact_greedy_rows(tiny_llama_dir: Path, mode: str) -> None:
    """Recompute rebuilds each matcher from the generated tokens; swap keeps it on the worker."""
    prompts = make_prompts()
    reference = hf_greedy(tiny_llama_dir, prompts)
    schema = SCHEMAS["required_and_optional"]
    constrained = [request(seed=50 + i, n=3, max_tokens=120, prompt=prompts[i % 4], json_schema=json.dumps(schema))
                   for i in range(4)]
    constrained += [request(seed=60 + i, n=3, max_tokens=60, prompt=prompts[i], regex=REGEXES[0]) for i in range(2)]
    plain = [ids_request(p, NEW_TOKENS) for p in prompts]
    with run_stack(tiny_llama_dir, "--block-size", "4", "--max-model-len", "512", "--max-num-blocks", "40",
                   "--memory-threshold", "1.0", "--preemption-mode", mode) as small:
        with ThreadPoolExecutor(len(constrained) + len(plain)) as pool_:
            answers = list(pool_.map(lambda r: small.inference.Complete(r, timeout=300), constrained + plain))
        # again, with the prompts' blocks in the prefix cache: the tiny pool may have evicted them while
        # the plain rows ran, so each prompt is cached once more, one at a time, just before
        for prompt in {tuple(prompts[i % 4]) for i in range(4)}:
            small.inference.Complete(ids_request(list(prompt), 1), timeout=300)
        with ThreadPoolExecutor(len(constrained)) as pool_:
            cached = list(pool_.map(lambda r: small.inference.Complete(r, timeout=300), constrained))
        stats = wait_for_idle(small)
        assert stats.num_preemptions > 0 and stats.used_blocks == 0 and pool(small).prefix_cache_hits > 0
    assert [list(a.token_ids) for a in answers[len(constrained):]] == reference  # token-exact greedy rows
    assert sum(a.usage.cached_prompt_tokens for a in cached) > 0
    for answer in answers[:len(constrained)] + cached:
        assert len(answer.choices) == 3
        for choice in answer.choices:
            assert choice.finish_reason == common_pb2.FINISH_REASON_STOP, choice.text
    for answer in answers[:4] + cached[:4]:
        for choice in answer.choices:
            jsonschema.validate(json.loads(choice.text), schema)
    for answer in answers[4:len(constrained)] + cached[4:]:
        assert all(re.fullmatch(REGEXES[0], c.text) for c in answer.choices)
    # the same seeds give the same samples with and without preemption and cache hits
    assert [[c.text for c in a.choices] for a in answers[:len(constrained)]] == [[c.text for c in a.choices]
                                                                                   for a in cached]


def test_tensor_parallel_ranks_follow_rank_0s_tokens(stack: Stack, tiny_llama_dir: Path) -> None:
    """Every rank keeps its own matchers and advances them with rank 0's token: greedy constrained output
    equals TP 1's, and random samples stay valid."""
    schema = SCHEMAS["nested_objects"]
    greedy = [request(seed=1, n=1, prompt=p, json_schema=json.dumps(schema)) for p in make_prompts()[:4]]
    for r in greedy:
        r.params.temperature = 0.0
    one = [stack.inference.Complete(r).text for r in greedy]
    with run_stack(tiny_llama_dir, "--block-size", "4", "--max-model-len", "512", "--tensor-parallel-size", "2") as tp2:
        two = [tp2.inference.Complete(r).text for r in greedy]
        texts = samples(tp2, seeded(20, json_schema=json.dumps(schema)))
    assert one == two
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
