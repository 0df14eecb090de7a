"""Prompt logprobs through the real stack (float32, the tiny Llama) against `transformers`' float32
log_softmax: gRPC `params.prompt_logprobs`, HTTP completions `echo` + `logprobs` (the shape
lm-evaluation-harness reads), vLLM's `prompt_logprobs` extension, max_tokens 0, n > 1, streaming,
a warm prefix cache. Every test runs on a stack computing each prompt in one step and on one
whose chunk budget splits prompts over several steps."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.bench.harness import Stack, run_stack, wait_for_idle

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-4
TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."


@pytest.fixture(scope="module", params=["whole", "chunked"])
def stack(request, tiny_llama_dir: Path):
    flags = ["--block-size", "4", "--max-model-len", "256"]
    if request.param == "chunked":
        flags += ["--max-prefill-chunk-tokens", "5"]  # a 30-token prompt takes six steps
    with run_stack(tiny_llama_dir, *flags, "--log-level", "warning") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def reference(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row p is the distribution of prompt token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]


def chosen(ref: torch.Tensor, ids: list[int]) -> list[float]:
    return ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()


def tokenize(stack: Stack, text: str) -> list[int]:
    return list(stack.inference.Tokenize(inference_pb2.TokenizeRequest(text=text)).token_ids)


def scoring_request(ids: list[int], prompt_logprobs: int, max_tokens: int = 2, **kw) -> inference_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                                          "prompt_logprobs": prompt_logprobs, **kw})
    return inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=ids), params=params)


def test_grpc_prompt_logprobs_match_transformers(stack: Stack, hf_model) -> None:
    ids = tokenize(stack, TEXT)
    assert len(ids) > 12
    ref = reference(hf_model, ids)
    answer = stack.inference.Complete(scoring_request(ids, 3))
    assert [lp.token_id for lp in answer.prompt_logprobs] == ids[1:]
    assert [lp.logprob for lp in answer.prompt_logprobs] == pytest.approx(chosen(ref, ids), abs=TOLERANCE)
    values, top_ids = ref.topk(3, dim=-1)
    assert len(answer.prompt_top_logprobs) == len(ids) - 1
    for p, alternatives in enumerate(answer.prompt_top_logprobs):
        assert [c.token_id for c in alternatives.candidates] == top_ids[p].tolist()
        assert [c.logprob for c in alternatives.candidates] == pytest.approx(values[p].tolist(), abs=TOLERANCE)
    assert answer.prompt_logprobs[0].token  # token text from the gateway's tokenizer
    messages = list(stack.inference.Generate(scoring_request(ids, 0, max_tokens=4)))
    assert len(messages[0].prompt_logprobs) == len(ids) - 1 and not any(m.prompt_logprobs for m in messages[1:])
    assert all(not alts.candidates for alts in messages[0].prompt_top_logprobs)  # prompt_logprobs 0: the token's own only


def test_http_echo_with_logprobs_is_what_lm_eval_reads(stack: Stack, client: openai.OpenAI, hf_model) -> None:
    ids = tokenize(stack, TEXT)
    ref = reference(hf_model, ids)
    plain = stack.inference.Complete(scoring_request(ids, 0, max_tokens=3, logprobs=0))
    out = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True})
    choice, n = out.choices[0], len(ids)
    assert choice.text == TEXT + plain.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(chosen(ref, ids), abs=TOLERANCE)
    top_values = ref.topk(2, dim=-1).values
    for p in range(1, n):
        top = lp.top_logprobs[p]
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(top_values[p - 1, 0].item(), abs=TOLERANCE)
    assert lp.token_logprobs[n:] == pytest.approx([x.logprob for x in plain.logprobs], abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(TEXT)
    assert lp.text_offset == sorted(lp.text_offset)
    assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 3
    # lm-evaluation-harness's likelihood: sum(token_logprobs[ctxlen:-1]) with max_tokens 1 and token-id prompts
    ctxlen = 5
    body = {"model": MODEL, "prompt": [ids], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    answer = httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=60).json()
    likelihood = sum(answer["choices"][0]["logprobs"]["token_logprobs"][ctxlen:-1])
    assert likelihood == pytest.approx(sum(chosen(ref, ids)[ctxlen - 1:]), abs=1e-3)


def test_warm_prefix_cache_gives_the_same_logprobs(stack: Stack, client: openai.OpenAI, hf_model) -> None:
    ids = tokenize(stack, TEXT + " Berlin is the capital of Germany.")
    stack.inference.Complete(inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=ids),
                                                           params=common_pb2.SamplingParams(max_tokens=1)))
    warm = stack.inference.Complete(inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=ids),
                                                                  params=common_pb2.SamplingParams(max_tokens=1)))
    assert warm.usage.cached_prompt_tokens > 0  # the cache holds this prompt
    answer = stack.inference.Complete(scoring_request(ids, 1))
    assert answer.usage.cached_prompt_tokens == 0  # not taken: cached positions have no logits
    assert [lp.logprob for lp in answer.prompt_logprobs] == pytest.approx(chosen(reference(hf_model, ids), ids),
                                                                          abs=TOLERANCE)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert out.choices[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(chosen(reference(hf_model, ids), ids),
                                                                               abs=TOLERANCE)
    assert wait_for_idle(stack).used_blocks == 0


def test_max_tokens_0_returns_just_the_prompt(stack: Stack, client: openai.OpenAI, hf_model) -> None:
    ids = tokenize(stack, TEXT)
    out = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True, logprobs=0)
    choice = out.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(chosen(reference(hf_model, ids), ids), abs=TOLERANCE)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    bare = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True)  # echo without logprobs
    assert bare.choices[0].text == TEXT and bare.choices[0].logprobs is None and bare.usage.completion_tokens == 0
    answer = stack.inference.Complete(scoring_request(ids, 2, max_tokens=0, logprobs=1))
    assert answer.text == "" and not answer.token_ids and not answer.logprobs
    assert answer.usage.completion_tokens == 0 and answer.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(answer.prompt_logprobs) == len(ids) - 1
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0)  # nothing asked of the prompt either


def test_n2_prompt_logprobs_on_sample_0_and_echo_in_every_choice(stack: Stack, client: openai.OpenAI, hf_model) -> None:
    ids = tokenize(stack, TEXT)
    messages = list(stack.inference.Generate(scoring_request(ids, 1, max_tokens=3, n=2, temperature=1.0, seed=5)))
    carrying = [m for m in messages if m.prompt_logprobs]
    assert len(carrying) == 1 and carrying[0].index == 0
    assert [lp.logprob for lp in carrying[0].prompt_logprobs] == pytest.approx(chosen(reference(hf_model, ids), ids),
                                                                               abs=TOLERANCE)
    out = client.completions.create(model=MODEL, prompt=[TEXT, "music and light"], n=2, max_tokens=2, echo=True,
                                    logprobs=1, seed=3)
    assert len(out.choices) == 4
    for choice in out.choices:
        prompt = TEXT if choice.index < 2 else "music and light"
        assert choice.text.startswith(prompt)
        assert choice.logprobs.token_logprobs[0] is None and None not in choice.logprobs.token_logprobs[1:]
    assert out.choices[0].logprobs.token_logprobs[:len(ids)] == out.choices[1].logprobs.token_logprobs[:len(ids)]


def test_vllm_prompt_logprobs_on_completions_and_chat(stack: Stack, hf_model) -> None:
    ids = tokenize(stack, TEXT)
    ref = reference(hf_model, ids)
    body = {"model": MODEL, "prompt": TEXT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    choice = httpx.post(f"{stack.http_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["text"] and not choice["text"].startswith(TEXT)  # no echo asked
    positions = choice["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    values, top_ids = ref.topk(2, dim=-1)
    for p, position in enumerate(positions[1:]):
        own = position[str(ids[p + 1])]
        assert own["logprob"] == pytest.approx(chosen(ref, ids)[p], abs=TOLERANCE) and own["decoded_token"] is not None
        for rank, (token_id, value) in enumerate(zip(top_ids[p].tolist(), values[p].tolist()), start=1):
            assert position[str(token_id)]["rank"] == rank
            assert position[str(token_id)]["logprob"] == pytest.approx(value, abs=TOLERANCE)
    messages = [{"role": "user", "content": "Where is Paris?"}]
    chat_ids = list(stack.inference.Tokenize(inference_pb2.TokenizeRequest(
        chat=inference_pb2.Chat(messages=[inference_pb2.ChatMessage(**m) for m in messages]))).token_ids)
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    choice = httpx.post(f"{stack.http_url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    got = [None] + [pos[str(t)]["logprob"] for pos, t in zip(choice["prompt_logprobs"][1:], chat_ids[1:])]
    assert len(choice["prompt_logprobs"]) == len(chat_ids) and choice["prompt_logprobs"][0] is None
    assert got[1:] == pytest.approx(chosen(reference(hf_model, chat_ids), chat_ids), abs=TOLERANCE)


def test_streamed_echo_sends_the_prompt_first(stack: Stack, client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, echo=True, logprobs=1,
                                      extra_body={"ignore_eos": True})
    body = {"model": MODEL, "prompt": TEXT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(TEXT) and first["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.choices[0].text
    streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
    offsets = [x for c in chunks for x in c["choices"][0]["logprobs"]["text_offset"]]
    n = len(tokenize(stack, TEXT))  # the prompt's offsets, and where the completion starts
    assert offsets[:n + 1] == whole.choices[0].logprobs.text_offset[:n + 1] and offsets[n] == len(TEXT)
