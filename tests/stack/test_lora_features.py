"""LoRA adapters with the other features, through the stack (issue 41, "With the other features"): in float32,
a request's logprobs and prompt logprobs under an adapter are PEFT's log-softmax; structured output holds
under an adapter; seeded sampling repeats; and with tensor parallelism 2 (the adapter's B split as its
layer is) every adapter's greedy tokens are PEFT's, for adapters loaded at start and at run time."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import grpc
import pytest
import torch

from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.bench.harness import free_port, run_stack, wait_for_idle
from tests.helpers.oracle import NEW_TOKENS, make_prompts
from tests.helpers.stack_requests import generate_concurrently
from tests.helpers.tiny_models import make_lora_adapter
from tests.model.test_lora_serving import ADAPTERS, peft_greedy

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("feature-loras")
    return {name: make_lora_adapter(tiny_llama_dir, root / name, rank, targets, seed=20 + i, rslora=rslora)
            for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items())}


def peft_log_softmax(base: Path, adapter: Path, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: PEFT's float32 log-softmax after each prefix of `ids`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                      str(adapter)).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_logprobs_prompt_logprobs_structured_and_seeded_under_an_adapter(tiny_llama_dir: Path, adapters) -> None:
    prompt = make_prompts()[4]  # 16 tokens
    with run_stack(tiny_llama_dir, "--block-size", "4", "--lora-modules",
                   ",".join(f"{n}={p}" for n, p in adapters.items())) as stack:
        api = stack.inference
        params = common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2,
                                           prompt_logprobs=2)
        answer = api.Complete(inference_pb2.GenerateRequest(
            model="all16", prompt_token_ids=inference_pb2.TokenIds(ids=prompt), params=params), timeout=120)
        tokens = list(answer.token_ids)
        assert tokens == peft_greedy(tiny_llama_dir, adapters["all16"], [prompt])[0]
        ref = peft_log_softmax(tiny_llama_dir, adapters["all16"], prompt + tokens)
        want_prompt = [ref[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)]
        assert [lp.logprob for lp in answer.prompt_logprobs] == pytest.approx(want_prompt, abs=TOLERANCE)
        want = [ref[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]
        assert [lp.logprob for lp in answer.logprobs] == pytest.approx(want, abs=TOLERANCE)
        for j, alternatives in enumerate(answer.top_logprobs):
            values, ids = ref[len(prompt) - 1 + j].topk(2)
            assert [c.token_id for c in alternatives.candidates] == ids.tolist()

        pattern = r"(cat|dog|bird)s? [0-9]{1,3}"
        constrained = api.Complete(inference_pb2.GenerateRequest(
            model="mlp64", prompt="Pick one:", params=common_pb2.SamplingParams(
                max_tokens=16, temperature=1.0, seed=3, regex=pattern)), timeout=120)
        assert re.fullmatch(pattern, constrained.text), constrained.text
        seeded = [api.Complete(inference_pb2.GenerateRequest(
            model="attn8", prompt_token_ids=inference_pb2.TokenIds(ids=prompt), params=common_pb2.SamplingParams(
                max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)), timeout=120)
            for _ in range(2)]
        assert seeded[0].token_ids == seeded[1].token_ids
        assert wait_for_idle(stack).used_blocks == 0


def test_tensor_parallel_2_serves_each_adapter_as_peft_does(tiny_llama_dir: Path, adapters) -> None:
    prompts = make_prompts()
    names = ["", "attn8", "mlp64", "all16"]
    modules = f"attn8={adapters['attn8']},mlp64={adapters['mlp64']}"
    with run_stack(tiny_llama_dir, "--block-size", "5", "--max-model-len", "512", "--tensor-parallel-size", "2",
                   "--worker-address", f"127.0.0.1:{free_port()}", "--lora-modules", modules,
                   "--lora-root", str(adapters["all16"].parent), "--log-level", "warning") as stack:
        stack.inference.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="all16", path=str(adapters["all16"])),
                                        timeout=60)  # on both ranks, at run time
        # A crafted adapter (an untyped error once, which ended a tensor-parallel worker): refused, the group serves on.
        crafted = Path(shutil.copytree(adapters["all16"], adapters["all16"].parent / "crafted", dirs_exist_ok=True))
        (crafted / "adapter_config.json").write_text('{"r": 16, "target_modules": ["q_proj"], "lora_alpha": {}}')
        with pytest.raises(grpc.RpcError) as info:
            stack.inference.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="crafted", path=str(crafted)),
                                            timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lora_alpha" in info.value.details()
        for name in names:
            got = generate_concurrently(stack, prompts, NEW_TOKENS, 120, model=name)
            assert got == peft_greedy(tiny_llama_dir, adapters.get(name), prompts), name or "base"
        assert wait_for_idle(stack).used_blocks == 0
