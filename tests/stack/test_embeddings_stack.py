"""Embeddings through the real stack (gateway, scheduler and two data-parallel workers, float32, the tiny Llama
with sentence-transformers' module files, mean pooling read from them) against sentence-transformers on the same weights: gRPC `Embed`
and the official `openai` client's `embeddings.create` (base64 and float), chunked inputs, generations in the
same steps, `dimensions`, the refusals (INVALID_ARGUMENT / 400 naming the field), a deadline, the metrics, and
no KV block left behind."""

from __future__ import annotations

import base64
import threading
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.bench.harness import (Stack, cosine, load_sentence_transformer, make_sentence_transformers_dir,
                                        run_stack, wait_for_idle)

pytestmark = pytest.mark.slow
MIN_COSINE = 0.99999
MAX_MODEL_LEN = 128
MAX_INPUTS = 8
TEXTS = ["a", "hello world", "query: how many KV blocks does a long input hold?",
         "The quick brown fox jumps over the lazy dog. " * 4]


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sentence_transformers_dir(tiny_llama_dir, tmp_path_factory.mktemp("st") / "m", "mean")


@pytest.fixture(scope="module")
def reference(model: Path) -> np.ndarray:
    return load_sentence_transformer(model).encode(TEXTS)


@pytest.fixture(scope="module")
def stack(model: Path):
    # Two data-parallel replicas: a request's inputs are routed over both, as generations are.
    with run_stack(model, "--block-size", "4", "--max-model-len", str(MAX_MODEL_LEN), "--max-prefill-chunk-tokens",
                   "8", "--serving-embedding-max-inputs", str(MAX_INPUTS), "--data-parallel-size", "2",
                   "--log-level", "warning") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


def embed(stack: Stack, *texts: str, **fields) -> inference_pb2.EmbedResponse:
    request = inference_pb2.EmbedRequest(**fields)
    for text in texts:
        request.inputs.add(text=text)
    return stack.inference.Embed(request, timeout=60)


def test_grpc_embed_matches_sentence_transformers(stack: Stack, reference: np.ndarray) -> None:
    answer = embed(stack, *TEXTS)
    assert [d.index for d in answer.data] == list(range(len(TEXTS)))
    for item, want in zip(answer.data, reference):
        assert cosine(item.values, want) >= MIN_COSINE
    assert answer.usage.prompt_tokens == sum(d.prompt_tokens for d in answer.data) == answer.usage.total_tokens
    assert answer.data[-1].prompt_tokens > 3 * 8  # over three prefill chunks
    cut = embed(stack, TEXTS[2], dimensions=16).data[0].values
    want = reference[2][:16] / np.linalg.norm(reference[2][:16])
    assert len(cut) == 16 and cosine(cut, want) >= MIN_COSINE and abs(np.linalg.norm(cut) - 1) < 1e-6
    raw = embed(stack, TEXTS[1], normalize=False).data[0].values
    assert cosine(raw, reference[1]) >= MIN_COSINE and abs(np.linalg.norm(raw) - 1) > 1e-3
    ids = stack.inference.Tokenize(inference_pb2.TokenizeRequest(text=TEXTS[3])).token_ids
    request = inference_pb2.EmbedRequest(encoding_format=inference_pb2.EMBEDDING_ENCODING_BASE64)
    request.inputs.add().token_ids.ids.extend(ids)
    encoded = stack.inference.Embed(request, timeout=60).data[0]
    assert not encoded.values and cosine(np.frombuffer(base64.b64decode(encoded.base64), "<f4"),
                                         reference[3]) >= MIN_COSINE


def test_the_openai_client(client: openai.OpenAI, reference: np.ndarray) -> None:
    answer = client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS)  # the client asks for base64
    assert answer.object == "list" and [d.index for d in answer.data] == list(range(len(TEXTS)))
    for item, want in zip(answer.data, reference):
        assert item.object == "embedding" and cosine(item.embedding, want) >= MIN_COSINE
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0
    single = client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS[2], encoding_format="float",
                                      dimensions=32, user="tests")
    want = reference[2][:32] / np.linalg.norm(reference[2][:32])
    assert len(single.data) == 1 and cosine(single.data[0].embedding, want) >= MIN_COSINE


def test_embeddings_while_generations_stream(stack: Stack, reference: np.ndarray) -> None:
    """Greedy generations stream while inputs are embedded: the vectors are the reference's and every
    generation gives the tokens it gives alone."""
    def generate(prompt: str) -> list[int]:
        params = common_pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        return list(stack.inference.Complete(inference_pb2.GenerateRequest(prompt=prompt, params=params),
                                             timeout=60).token_ids)

    prompts = [f"Story number {i}:" for i in range(4)]
    alone = [generate(p) for p in prompts]
    together: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, generate(prompts[i]))) for i in range(4)]
    for t in threads:
        t.start()
    answers = [embed(stack, *TEXTS) for _ in range(3)]
    for t in threads:
        t.join()
    assert [together[i] for i in range(4)] == alone
    for answer in answers:
        for item, want in zip(answer.data, reference):
            assert cosine(item.values, want) >= MIN_COSINE
    assert wait_for_idle(stack).used_blocks == 0


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": ["ok", ""]}, "input"),
    ({"input": "word " * 400}, "input"), ({"input": [[1, 2], []]}, "input[1]"), ({"input": [10**6]}, "input"),
    ({"input": "x", "dimensions": 0}, "dimensions"), ({"input": "x", "dimensions": 65}, "dimensions"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "pooling": "max"}, "pooling"), ({"input": "x", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"input": "x", "model": "other-model"}, "model"),
])
def test_bad_http_bodies_get_a_400_naming_the_field(stack: Stack, body: dict, param: str) -> None:
    response = httpx.post(f"{stack.http_url}/v1/embeddings", json=body, timeout=60)
    expected = 404 if param == "model" else 400
    assert response.status_code == expected, response.text
    error = response.json()["error"]
    assert error["param"] == param or param in error["message"], error


@pytest.mark.parametrize("inputs, fields, needle", [
    ([], {}, "at least one input"), ([inference_pb2.EmbedInput(text="")], {}, "inputs[0].text must not be empty"),
    ([inference_pb2.EmbedInput()], {}, "one of text, token_ids or chat"),
    ([inference_pb2.EmbedInput(token_ids=inference_pb2.TokenIds(ids=[10**6]))], {}, "outside the vocabulary"),
    ([inference_pb2.EmbedInput(text="word " * 400)], {}, "max_model_len is 128"),
    ([inference_pb2.EmbedInput(text="x")] * (MAX_INPUTS + 1), {}, "serving.embedding.max_inputs"),
    ([inference_pb2.EmbedInput(text="x")], {"dimensions": 65}, "dimensions is 65"),
    ([inference_pb2.EmbedInput(text="x")], {"pooling": 9}, "pooling"),
])
def test_bad_grpc_requests_are_invalid_argument(stack: Stack, inputs: list, fields: dict, needle: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        stack.inference.Embed(inference_pb2.EmbedRequest(inputs=inputs, **fields), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in refused.value.details()


def test_an_input_may_fill_max_model_len_and_nothing_leaks(stack: Stack) -> None:
    request = inference_pb2.EmbedRequest()
    request.inputs.add().token_ids.ids.extend([5 + i % 50 for i in range(MAX_MODEL_LEN)])
    assert len(stack.inference.Embed(request, timeout=60).data[0].values) == 64
    assert wait_for_idle(stack).used_blocks == 0
    metrics = httpx.get(f"{stack.http_url}/metrics", timeout=30).text
    counted = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
               if line.startswith("hetero_embedding_") and not line.startswith("#")}
    assert counted["hetero_embedding_request_success_total"] >= 1
    assert counted["hetero_embedding_inputs_total"] >= 1 and counted["hetero_embedding_prompt_tokens_total"] >= MAX_MODEL_LEN


def test_a_passed_deadline_ends_the_request_and_frees_its_blocks(stack: Stack) -> None:
    request = inference_pb2.EmbedRequest(request_id="late")
    for _ in range(MAX_INPUTS):
        request.inputs.add().token_ids.ids.extend([5 + i % 50 for i in range(MAX_MODEL_LEN)])
    with pytest.raises(grpc.RpcError) as late:
        stack.inference.Embed(request, timeout=0.05)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for_idle(stack).used_blocks == 0
    assert len(embed(stack, "still serving").data) == 1
