"""The real three-process stack on loopback: gateway, scheduler and worker talking gRPC."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest

from hetero.v1 import common_pb2, inference_pb2
from tests.helpers.oracle import NEW_TOKENS, hf_greedy, make_prompts
from hetero_infer.bench.harness import Stack, run_stack, wait_for_idle
from tests.helpers.stack_requests import greedy, ids_request
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path):
    with run_stack(tiny_llama_dir, "--block-size", "5", "--max-model-len", "512") as s:
        yield s


def test_batch_through_stack_matches_transformers(stack: Stack, tiny_llama_dir: Path) -> None:
    prompts = make_prompts()
    reference = hf_greedy(tiny_llama_dir, prompts)
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        tokens: list[int] = []
        for msg in stack.inference.Generate(ids_request(prompts[i], NEW_TOKENS)):
            tokens.extend(msg.token_ids)
        results[i] = tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(len(prompts))] == reference
    assert wait_for_idle(stack).used_blocks == 0


def test_stream_ends_with_finish_reason_and_usage(stack: Stack) -> None:
    messages = list(stack.inference.Generate(inference_pb2.GenerateRequest(
        request_id="usage-1", prompt="Paris is the capital", params=greedy(6))))
    assert all(m.request_id == "usage-1" for m in messages)
    assert all(m.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    last = messages[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 6 == sum(len(m.token_ids) for m in messages)
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6
    unary = stack.inference.Complete(inference_pb2.GenerateRequest(prompt="Paris is the capital", params=greedy(6)))
    assert unary.text == "".join(m.text for m in messages)
    assert list(unary.token_ids) == [t for m in messages for t in m.token_ids]


def test_continuous_batching_short_request_overtakes(stack: Stack) -> None:
    order: list[str] = []
    lock = threading.Lock()
    started = threading.Event()

    def run(name: str, max_tokens: int) -> None:
        for msg in stack.inference.Generate(ids_request([5, 6, 7, 8], max_tokens, request_id=name)):
            started.set()
            if msg.finish_reason:
                with lock:
                    order.append(name)

    longs = [threading.Thread(target=run, args=(f"long-{i}", 400)) for i in range(3)]
    for t in longs:
        t.start()
    assert started.wait(30)
    # The short one comes once the long ones are decoding together (not after a fixed number of looks).
    wait_until(lambda: stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest()).pool.num_running > 1,
               interval=0.005, what="two or more of the long requests running at once")
    short = threading.Thread(target=run, args=("short", 3))
    short.start()
    for t in [short, *longs]:
        t.join(120)
    assert order[0] == "short", order


def test_cancelling_50_streams_frees_every_block(stack: Stack) -> None:
    calls = [stack.inference.Generate(ids_request(make_prompts(seed=i)[3], 400, request_id=f"cancel-{i}")) for i in range(50)]
    for call in calls[:10]:
        next(call)  # at least some are decoding when cancelled
    busy = stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest()).pool
    assert busy.used_blocks > 0
    for call in calls:
        call.cancel()
    pool = wait_for_idle(stack)
    assert (pool.used_blocks, pool.num_running, pool.num_waiting) == (0, 0, 0)


BAD_REQUESTS = [
    ("prompt", inference_pb2.GenerateRequest(prompt="", params=greedy(4))),
    ("temperature", inference_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(temperature=2.5))),
    ("temperature", inference_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(temperature=-0.1))),
    ("top_p", inference_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(top_p=0.0))),
    ("top_p", inference_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(top_p=1.5))),
    ("max_tokens", inference_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(max_tokens=0))),
    ("max_model_len", inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=[5] * 600))),
    ("model", inference_pb2.GenerateRequest(prompt="hi", model="gpt-9")),
    ("prompt", inference_pb2.GenerateRequest(params=greedy(4))),
    ("prompt_token_ids", inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=[10**6]))),
    ("chat.messages", inference_pb2.GenerateRequest(chat=inference_pb2.Chat())),
]


@pytest.mark.parametrize("field, request_msg", BAD_REQUESTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_REQUESTS)])
def test_bad_input_is_invalid_argument_naming_the_field(stack: Stack, field: str, request_msg) -> None:
    for call in (lambda r: list(stack.inference.Generate(r)), stack.inference.Complete):
        with pytest.raises(grpc.RpcError) as info:
            call(request_msg)
        # an unknown model (or LoRA adapter) is NOT_FOUND, as HTTP's 404
        assert info.value.code() == (grpc.StatusCode.NOT_FOUND if field == "model" else grpc.StatusCode.INVALID_ARGUMENT)
        assert field in info.value.details()
    # ... and the service keeps serving.
    assert stack.inference.Complete(inference_pb2.GenerateRequest(prompt="hi", params=greedy(2))).usage.completion_tokens == 2


def test_tokenize_list_models_and_info(stack: Stack) -> None:
    tok = stack.inference.Tokenize(inference_pb2.TokenizeRequest(text="Paris is the capital"))
    assert tok.count == len(tok.token_ids) > 0 and tok.max_model_len == 512
    models = stack.inference.ListModels(inference_pb2.ListModelsRequest()).models
    assert len(models) == 1 and models[0].has_chat_template
    assert (models[0].architecture, models[0].num_experts, models[0].num_experts_per_tok) == ("llama", 0, 0)
    info = stack.inference.GetServerInfo(inference_pb2.GetServerInfoRequest())
    assert info.pool.block_size == 5 and info.pool.total_blocks > 0 and info.attention_backend == "torch"


def test_health_and_reflection(stack: Stack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    status = health_pb2_grpc.HealthStub(stack.channel).Check(health_pb2.HealthCheckRequest(service="hetero.v1.Inference"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"hetero.v1.Inference", "grpc.health.v1.Health"} <= names


def test_stop_string_ends_the_stream_before_the_match(stack: Stack) -> None:
    request = inference_pb2.GenerateRequest(prompt="The quick brown fox", params=greedy(24))
    full = stack.inference.Complete(request).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    request.params.stop.append(stop)
    messages = list(stack.inference.Generate(request))
    text = "".join(m.text for m in messages)
    assert text == full[: full.find(stop)]
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP and messages[-1].stop_reason == stop
    assert wait_for_idle(stack).used_blocks == 0


def test_chat_request_uses_the_template(stack: Stack) -> None:
    chat = inference_pb2.Chat(messages=[inference_pb2.ChatMessage(role="user", content="hi")])
    tok = stack.inference.Tokenize(inference_pb2.TokenizeRequest(chat=chat))
    answer = stack.inference.Complete(inference_pb2.GenerateRequest(chat=chat, params=greedy(3)))
    assert answer.usage.prompt_tokens == tok.count
    assert answer.finish_reason == common_pb2.FINISH_REASON_LENGTH


@pytest.mark.parametrize("model, block_size", [("llama", 1), ("llama", 16), ("qwen2", 5)])
def test_stack_matches_transformers_across_models_and_block_sizes(
        tiny_llama_dir: Path, tiny_qwen2_dir: Path, model: str, block_size: int) -> None:
    """The same oracle as the module's stack, on fresh stacks: other block sizes, Qwen2's biases."""
    model_dir = tiny_llama_dir if model == "llama" else tiny_qwen2_dir
    prompts = make_prompts()
    reference = hf_greedy(model_dir, prompts)
    with run_stack(model_dir, "--block-size", str(block_size), "--max-model-len", "512") as s:
        calls = [s.inference.Generate(ids_request(p, NEW_TOKENS)) for p in prompts]
        # All eight streams are open before any is read, so the scheduler batches them together.
        results = [[t for msg in call for t in msg.token_ids] for call in calls]
        assert results == reference
        assert wait_for_idle(s).used_blocks == 0


def controls(**kw) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(prompt="hi", params=common_pb2.SamplingParams(**kw))


BAD_CONTROLS = [
    ("frequency_penalty", controls(frequency_penalty=2.5)), ("frequency_penalty", controls(frequency_penalty=float("nan"))),
    ("presence_penalty", controls(presence_penalty=-3.0)), ("presence_penalty", controls(presence_penalty=float("inf"))),
    ("repetition_penalty", controls(repetition_penalty=0.0)), ("repetition_penalty", controls(repetition_penalty=2.5)),
    ("min_p", controls(min_p=1.5)), ("min_p", controls(min_p=-0.5)),
    ("min_tokens", controls(min_tokens=101)), ("min_tokens", controls(max_tokens=3, min_tokens=4)),
    ("logit_bias", controls(logit_bias={10**6: 1.0})), ("logit_bias", controls(logit_bias={5: -101.0})),
    ("logit_bias", controls(logit_bias={i: 1.0 for i in range(1025)})),
    ("prompt_logprobs", controls(prompt_logprobs=21)),
]


@pytest.mark.parametrize("field, request_msg", BAD_CONTROLS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_CONTROLS)])
def test_bad_sampling_controls_are_invalid_argument_naming_the_field(stack: Stack, field: str, request_msg) -> None:
    test_bad_input_is_invalid_argument_naming_the_field(stack, f"params.{field}", request_msg)


def test_repetition_penalty_through_stack_matches_transformers(stack: Stack, tiny_llama_dir: Path) -> None:
    prompts = make_prompts()
    reference = hf_greedy(tiny_llama_dir, prompts, 20, repetition_penalty=1.3)
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:  # concurrently, so penalised rows share steps with the plain request below
        request = ids_request(prompts[i], 20)
        request.params.repetition_penalty = 1.3
        results[i] = [t for msg in stack.inference.Generate(request) for t in msg.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    plain = [t for msg in stack.inference.Generate(ids_request(prompts[0], 20)) for t in msg.token_ids]
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(len(prompts))] == reference
    assert plain == hf_greedy(tiny_llama_dir, prompts[:1], 20)[0]
    assert wait_for_idle(stack).used_blocks == 0
