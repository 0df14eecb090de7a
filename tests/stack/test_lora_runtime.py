"""LoRA adapters loaded and unloaded at run time through the whole stack (issue 41, Done means 2 and 4):
LoadLoraAdapter / UnloadLoraAdapter / ListLoraAdapters over gRPC and their HTTP routes behind the API key;
every bad adapter and bad call gets its own clear error and the service keeps serving; 32 streams over 8
adapters run while other adapters come and go, and none fails, mixes adapters or leaks a block; a worker
SIGKILLed mid-stream with data parallelism 2 changes no stream, and its restart serves the adapters loaded
since it started."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hetero.v1 import common_pb2, inference_pb2, worker_pb2, worker_pb2_grpc
from hetero_infer.bench.harness import free_port, make_random_llama, run_stack, service_stats, wait_for_idle
from tests.helpers.oracle import NEW_TOKENS, make_prompts
from tests.helpers.tiny_models import make_lora_adapter
from tests.model.test_lora_serving import peft_greedy
from tests.stack.test_resilience import killer, run_streams, stack_flags, worker_pid

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"  # serving.model_name's default
KEY = "sk-lora-test"
AUTH = [("authorization", f"Bearer {KEY}")]
STREAM_TOKENS = 40


def samples(url: str) -> dict[tuple[str, str], float]:
    """/metrics as {(sample name, its adapter label or ""): value}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, s.labels.get("adapter", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def greedy(prompt: list[int], model: str = "", max_tokens: int = NEW_TOKENS) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(model=model, prompt_token_ids=inference_pb2.TokenIds(ids=prompt),
                                         params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                          ignore_eos=True))


def refused(call, request, code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(request, metadata=AUTH, timeout=60)
    assert info.value.code() == code, info.value.details()
    for word in words:
        assert word in info.value.details(), info.value.details()


@pytest.fixture(scope="module")
def loras(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runtime-loras")
    made = {f"a{i}": make_lora_adapter(tiny_llama_dir, root / f"a{i}", (8, 16)[i % 2],
                                       [["q_proj", "v_proj"], ["gate_proj", "down_proj"], ["o_proj", "up_proj"]][i % 3],
                                       seed=10 + i) for i in range(10)}
    made["big"] = make_lora_adapter(tiny_llama_dir, root / "big", 32, ["q_proj"], seed=3)
    other = make_random_llama(root / "other-base", hidden=96, intermediate=128, layers=2, heads=4, kv_heads=2,
                              vocab=512)
    made["foreign"] = make_lora_adapter(other, root / "foreign", 8, ["q_proj"], seed=4)
    lacking = make_lora_adapter(tiny_llama_dir, root / "lacking", 8, ["q_proj"], seed=5)
    settings = json.loads((lacking / "adapter_config.json").read_text())
    settings["target_modules"] = ["q_proj", "fc1"]
    (lacking / "adapter_config.json").write_text(json.dumps(settings))
    made["lacking"] = lacking
    return made


def lora_root(loras: dict[str, Path]) -> str:
    """The directory holding the adapters: the workers' lora_root, which run-time loads must lie under."""
    return str(loras["a0"].parent)


def test_load_select_replace_unload_and_every_bad_call_refused(tiny_llama_dir: Path, loras) -> None:
    prompt = make_prompts()[0]
    with run_stack(tiny_llama_dir, "--block-size", "4", "--max-loras", "2", "--max-lora-rank", "16",
                   "--serving-admin-api-keys", KEY, "--lora-root", lora_root(loras)) as stack:
        api = stack.inference
        assert not api.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(), metadata=AUTH).adapters
        with pytest.raises(grpc.RpcError) as info:  # no key: refused before anything loads
            api.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="a0", path=str(loras["a0"])), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        loaded = api.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="a0", path=str(loras["a0"])),
                                     metadata=AUTH, timeout=60)
        assert (loaded.name, loaded.rank, list(loaded.target_modules)) == ("a0", 8, ["q_proj", "v_proj"])
        answer = api.Complete(greedy(prompt, "a0"), metadata=AUTH, timeout=60)
        assert answer.model == "a0" and list(answer.token_ids) == peft_greedy(tiny_llama_dir, loras["a0"], [prompt])[0]

        # Bad adapters: each its own error, nothing loaded, the base and a0 serving on.
        for name, path, words in (("gone", "/nowhere/at/all", ("not under the worker's lora_root",)),
                                  ("lost", loras["a0"].parent / "lost", ("does not exist under",)),
                                  ("big", loras["big"], ("rank 32 is over max_lora_rank (16)",)),
                                  ("foreign", loras["foreign"], ("trained for another base model",)),
                                  ("lacking", loras["lacking"], ("fc1",))):
            refused(api.LoadLoraAdapter, common_pb2.LoadLoraAdapterRequest(name=name, path=str(path)),
                    grpc.StatusCode.INVALID_ARGUMENT, *words)
        # Bad calls.
        refused(api.LoadLoraAdapter, common_pb2.LoadLoraAdapterRequest(name="a0", path=str(loras["a1"])),
                grpc.StatusCode.ALREADY_EXISTS, "'a0' is loaded already", "replace")
        refused(api.LoadLoraAdapter, common_pb2.LoadLoraAdapterRequest(name=MODEL, path=str(loras["a1"])),
                grpc.StatusCode.INVALID_ARGUMENT, "served model")
        refused(api.LoadLoraAdapter, common_pb2.LoadLoraAdapterRequest(name="bad name!", path=str(loras["a1"])),
                grpc.StatusCode.INVALID_ARGUMENT, "'bad name!'")
        refused(api.LoadLoraAdapter, common_pb2.LoadLoraAdapterRequest(name="a1"),
                grpc.StatusCode.INVALID_ARGUMENT, "path is empty")
        refused(api.UnloadLoraAdapter, common_pb2.UnloadLoraAdapterRequest(name="never"),
                grpc.StatusCode.NOT_FOUND, "'never'")
        refused(api.UnloadLoraAdapter, common_pb2.UnloadLoraAdapterRequest(), grpc.StatusCode.NOT_FOUND, "''")
        assert [a.name for a in api.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest(), metadata=AUTH).adapters] \
            == ["a0"]

        # Replace: a0 now means a1's weights, in a new slot; the prefix cache does not serve the old K/V.
        replaced = api.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="a0", path=str(loras["a1"]),
                                                                         replace=True), metadata=AUTH, timeout=60)
        assert replaced.slot != loaded.slot and replaced.rank == 16
        answer = api.Complete(greedy(prompt, "a0"), metadata=AUTH, timeout=60)
        assert list(answer.token_ids) == peft_greedy(tiny_llama_dir, loras["a1"], [prompt])[0]
        # Both slots taken until the replaced adapter's slot drains (at once: nothing uses it).
        deadline = time.monotonic() + 10
        while True:
            try:
                api.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="a2", path=str(loras["a2"])),
                                    metadata=AUTH, timeout=60)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline
                time.sleep(0.05)
        refused(api.LoadLoraAdapter, common_pb2.LoadLoraAdapterRequest(name="a3", path=str(loras["a3"])),
                grpc.StatusCode.FAILED_PRECONDITION, "max_loras")

        # Unload: the name is gone at once; the base model serves on.
        assert api.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(name="a0"), metadata=AUTH,
                                     timeout=60).waited_requests == 0
        refused(api.Complete, greedy(prompt, "a0"), grpc.StatusCode.NOT_FOUND, "'a0'", "'a2'")
        assert api.Complete(greedy(prompt), metadata=AUTH, timeout=60).model == MODEL

        # The HTTP routes, behind the same key.
        url, headers = stack.http_url, {"authorization": f"Bearer {KEY}"}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "h", "lora_path": str(loras["a3"])},
                          timeout=60).status_code == 401
        response = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "h", "lora_path": str(loras["a3"])},
                              headers=headers, timeout=60)
        assert response.status_code == 200 and response.json()["name"] == "h"
        for body, status in (({"lora_name": "h", "lora_path": str(loras["a4"])}, 409),
                             ({"lora_name": "x", "lora_path": str(loras["a4"])}, 409),  # both slots taken
                             ({"lora_name": "bad name", "lora_path": str(loras["a4"])}, 400),
                             ({"lora_name": "x", "lora_path": str(loras["a4"]), "load_inplace": True}, 400)):
            response = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers, timeout=60)
            assert response.status_code == status, response.text
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"]
        assert [m["id"] for m in models] == [MODEL, "a2", "h"]
        listed = httpx.get(f"{url}/v1/lora_adapters", headers=headers, timeout=30).json()["data"]
        assert [(a["name"], a["active_requests"]) for a in listed] == [("a2", 0), ("h", 0)]
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "h"}, headers=headers,
                          timeout=60).json() == {"waited_requests": 0}
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "h"}, headers=headers,
                          timeout=60).status_code == 404
        info = api.GetServerInfo(inference_pb2.GetServerInfoRequest(), metadata=AUTH, timeout=10)
        assert (info.pool.used_blocks, info.pool.num_running) == (0, 0)


def test_32_streams_over_8_adapters_while_adapters_load_and_unload(tiny_llama_dir: Path, loras) -> None:
    """Done means 2: the streams all get PEFT's tokens for their own adapter; an unload of an adapter in use
    waits for its streams, which finish with it; no block is left in use."""
    prompts = [p for seed in range(4) for p in make_prompts(seed=seed)]  # 32 prompts of 1 to 50 tokens
    names = [f"a{i % 8}" for i in range(32)]
    modules = ",".join(f"a{i}={loras[f'a{i}']}" for i in range(8))
    with run_stack(tiny_llama_dir, "--block-size", "4", "--max-loras", "11", "--lora-modules", modules,
                   "--num-threads", "1", "--lora-root", lora_root(loras)) as stack:
        api = stack.inference
        streams: dict[int, list[int]] = {}
        first_tokens: set[int] = set()
        all_started = threading.Event()

        def stream(i: int) -> None:
            tokens: list[int] = []
            for part in api.Generate(greedy(prompts[i], names[i], STREAM_TOKENS), timeout=300):
                assert part.model == names[i]
                tokens += part.token_ids
                first_tokens.add(i)
                if len(first_tokens) < 32:
                    all_started.wait(timeout=120)  # hold the stream (its sequence runs on) until all have started
                else:
                    all_started.set()
            streams[i] = tokens

        with ThreadPoolExecutor(32) as pool, ThreadPoolExecutor(1) as unloader:
            futures = [pool.submit(stream, i) for i in range(32)]
            while not all_started.wait(timeout=0.1):  # every stream has its first tokens: all 32 are running
                for future in futures:
                    if future.done():
                        future.result()  # a stream that failed says why
            unload_a7 = unloader.submit(api.UnloadLoraAdapter, common_pb2.UnloadLoraAdapterRequest(name="a7"),
                                        timeout=300)
            for round_ in range(3):  # others come and go while the streams run
                for extra in ("a8", "a9"):
                    api.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name=extra, path=str(loras[extra])),
                                        timeout=60)
                extra_answer = api.Complete(greedy(prompts[round_], "a8"), timeout=120)
                assert list(extra_answer.token_ids) == peft_greedy(tiny_llama_dir, loras["a8"], [prompts[round_]])[0]
                for extra in ("a8", "a9"):
                    api.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(name=extra), timeout=60)
            for future in futures:
                future.result()
            assert unload_a7.result().waited_requests == 4  # a7's four streams, which it waited for
        for name in sorted(set(names)):
            mine = [i for i in range(32) if names[i] == name]
            assert [streams[i] for i in mine] == peft_greedy(tiny_llama_dir, loras[name], [prompts[i] for i in mine],
                                                             STREAM_TOKENS), name
        listed = api.ListLoraAdapters(common_pb2.ListLoraAdaptersRequest()).adapters
        assert [a.name for a in listed] == [f"a{i}" for i in range(7)]
        assert wait_for_idle(stack).used_blocks == 0
        metrics = samples(stack.http_url)
        assert metrics[("hetero_lora_request_success_total", "a0")] == 4
        assert metrics[("hetero_lora_generation_tokens_total", "a7")] == 4 * STREAM_TOKENS
        assert metrics[("hetero_lora_request_success_total", "a8")] == 3  # one request each round
        assert (metrics[("hetero_lora_adapters_loaded", "")], metrics[("hetero_lora_slots_in_use", "")]) == (7, 7)


def test_a_replica_killed_mid_stream_keeps_every_streams_adapter(tiny_llama_dir: Path, loras) -> None:
    """Done means 1 under failure: two replicas, a small pool (preemption), adapters from lora_modules and one
    loaded at run time; one worker SIGKILLed mid-stream. Its sequences are recomputed on the other replica with
    their own adapters, and every stream is PEFT's. The restarted worker gets the adapter loaded at run time
    before its first step, and serves it."""
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    modules = f"a0={loras['a0']},a1={loras['a1']}"
    flags = stack_flags(addresses, "--lora-modules", modules, "--max-num-blocks", "48", "--max-loras", "4",
                        "--lora-root", lora_root(loras))
    prompts = [p for seed in range(2) for p in make_prompts(seed=seed)]  # 16 prompts of 1 to 50 tokens
    names = ["", "a0", "a1", "a2"]
    streams = [greedy(prompt, names[i % 4], STREAM_TOKENS) for i, prompt in enumerate(prompts)]
    with run_stack(tiny_llama_dir, *flags) as stack:
        api = stack.inference
        api.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(name="a2", path=str(loras["a2"])), timeout=60)
        victim = worker_pid(addresses[1])
        on_progress, killed = killer(lambda: victim, after_tokens=len(streams) * 5)
        disturbed = run_streams(stack, on_progress, streams=streams)
        assert killed.is_set() and all(code is None for _, code in disturbed.values())
        for name in names:
            mine = [i for i in range(len(prompts)) if names[i % 4] == name]
            assert [disturbed[i][0] for i in mine] == peft_greedy(
                tiny_llama_dir, loras.get(name), [prompts[i] for i in mine], STREAM_TOKENS), name or "base"
        assert service_stats(stack).num_recovered_sequences > 0
        deadline = time.monotonic() + 60
        while service_stats(stack).num_workers_up < 2:  # the supervisor restarts the killed worker
            assert time.monotonic() < deadline, "the killed worker did not come back"
            time.sleep(0.2)
        assert worker_pid(addresses[1]) != victim
        with ThreadPoolExecutor(8) as pool:  # enough at once that the restarted replica takes some
            answers = list(pool.map(lambda p: api.Complete(greedy(p, "a2"), timeout=120), prompts[:8]))
        assert [list(a.token_ids) for a in answers] == peft_greedy(tiny_llama_dir, loras["a2"], prompts[:8])
        with grpc.insecure_channel(addresses[1]) as channel:  # the new worker process holds a2 in a2's slot
            held = worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10).lora_adapters
        assert sorted(a.name for a in held) == ["a0", "a1", "a2"]
        assert wait_for_idle(stack).used_blocks == 0
