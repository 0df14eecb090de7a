"""LoRA adapters through the whole stack (issue 41; gateway, scheduler, worker as processes, the tiny model in
float32): a request's `model` names an adapter of `lora_modules` over gRPC and HTTP (the official `openai`
client), requests of several adapters and of the base run concurrently, and each gets PEFT's greedy tokens;
ListModels and /v1/models list the adapters; an unknown name is NOT_FOUND / 404; no block is left in use."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.bench.harness import run_stack, wait_for_idle
from tests.helpers.tiny_models import make_lora_adapter
from tests.helpers.oracle import NEW_TOKENS, make_prompts
from tests.model.test_lora_serving import ADAPTERS, peft_greedy

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"  # serving.model_name's default


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stack-loras")
    return {name: make_lora_adapter(tiny_llama_dir, root / name, rank, targets, seed=i, rslora=rslora)
            for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items())}


def test_requests_name_adapters_and_get_peft_tokens_over_grpc_and_http(tiny_llama_dir: Path, adapters) -> None:
    prompts = make_prompts()[:8]
    names = ["", *ADAPTERS]
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    with run_stack(tiny_llama_dir, "--dtype", "float32", "--block-size", "4", "--lora-modules", modules) as stack:
        def complete(i: int) -> inference_pb2.GenerateResponse:
            request = inference_pb2.GenerateRequest(
                request_id=f"r{i}", model=names[i % 4], prompt_token_ids=inference_pb2.TokenIds(ids=prompts[i]),
                params=common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
            return stack.inference.Complete(request, timeout=120)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(complete, range(len(prompts))))
        assert [a.model for a in answers[:4]] == [MODEL, *ADAPTERS]
        for name in names:
            mine = [i for i in range(len(prompts)) if names[i % 4] == name]
            assert [list(answers[i].token_ids) for i in mine] == peft_greedy(
                tiny_llama_dir, adapters.get(name), [prompts[i] for i in mine]), name or "base"
        listed = [m.id for m in stack.inference.ListModels(inference_pb2.ListModelsRequest()).models]
        assert listed == [MODEL, *ADAPTERS]
        with pytest.raises(grpc.RpcError) as info:
            stack.inference.Complete(inference_pb2.GenerateRequest(model="nope", prompt="hi"), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'attn8'" in info.value.details()

        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
        for i in (1, 2, 4):  # adapters attn8, mlp64 and the base model: the gRPC answers' text
            name = names[i % 4] or MODEL
            answer = client.completions.create(model=name, prompt=prompts[i], max_tokens=NEW_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
            assert answer.choices[0].text == answers[i].text and answer.model == name
        assert [m.id for m in client.models.list().data] == [MODEL, *ADAPTERS]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="hi", max_tokens=2)
        assert wait_for_idle(stack).used_blocks == 0
