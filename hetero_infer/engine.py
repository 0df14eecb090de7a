"""The in-process engine: the same Scheduler and ModelRunner as the services, without gRPC.

    engine = InferenceEngine(config)
    rid = engine.submit_request("Hello, world!", GenerationParams(max_tokens=50))
    for result in engine.run():
        print(result.request_id, result.output_text)

Tests and embedders use it; the step plans and results are the same protobuf messages the
services exchange, so both paths run the same code: the engine loop's step is the replicas' own
(scheduler_svc/replicas/engine_loop.py), its executor the local ModelRunner instead of a worker over gRPC.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from gateway.embedding_inputs import tokenize_inputs
from gateway.text.text_stream import TextStream
from gateway.validation import prepare
from gpu_worker.runner import ModelRunner
from hetero.v1 import common_pb2, inference_pb2, worker_pb2
from hetero_common.config import Config
from hetero_common.device_defaults import fitted_to_worker
from hetero_common.embedding_vectors import EMBEDDING_PARAMS, POOLING_BY_NAME, default_pooling, finish_vector
from hetero_common.errors import ExecutionError, ValidationError
from hetero_common.finish_reasons import finish_reason_name, is_finished
from hetero_common.lora_modules import lora_cache_salt, lora_slot
from hetero_common.tokenizer import TextTokenizer, load_tokenizer
from scheduler_svc.core.scheduler import Scheduler, StepOutputs
from scheduler_svc.replicas.engine_loop import EngineLoop, SentStep


@dataclass
class GenerationParams:
    max_tokens: int = 100
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # parallel samples; each finishes as its own CompletedRequest (same request_id, index 0..n-1)
    # The logits controls (docs/api.md, SamplingParams); the defaults are off.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def to_proto(self) -> common_pb2.SamplingParams:
        p = common_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                      top_k=self.top_k, stop=self.stop, stop_token_ids=self.stop_token_ids,
                                      ignore_eos=self.ignore_eos, n=self.n, frequency_penalty=self.frequency_penalty,
                                      presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                                      min_p=self.min_p, min_tokens=self.min_tokens, logit_bias=self.logit_bias)
        if self.seed is not None:
            p.seed = self.seed
        return p


@dataclass
class CompletedRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_text: str
    finish_reason: str  # stop | length | abort | error
    index: int = 0  # which sample (n > 1)
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache

    @property
    def generated_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class MemoryStats:
    total_blocks: int
    used_blocks: int
    free_blocks: int
    num_sequences: int
    cached_blocks: int = 0  # free blocks still holding a prefix-cache entry
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    num_swapped: int = 0
    internal_waste: float = 0.0


@dataclass
class _Pending:
    prompt_token_ids: list[int]
    stream: TextStream
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    cached_prompt_tokens: int = 0


class _RunnerExecutor:
    """The engine loop's StepExecutor in process: a step runs on the engine's ModelRunner when its result is
    asked for (so it never waits, and `EngineLoop.step_now` runs it); its outputs go to the engine."""

    def __init__(self, engine: InferenceEngine) -> None:
        self._engine = engine

    def send_step(self, plan: worker_pb2.StepPlan) -> None:
        return None

    async def receive_step(self, sent: SentStep) -> worker_pb2.StepResult:
        return self._engine.runner.execute(sent.plan)  # looked up per step: tests and benchmarks wrap it

    def cancel_step(self, sent: SentStep) -> None:  # never called: nothing is planned ahead in process
        pass

    def dispatch_step(self, outputs: StepOutputs, sent: SentStep, result: worker_pb2.StepResult) -> None:
        self._engine._take_outputs(outputs)


class InferenceEngine:
    def __init__(self, config: Config | None = None, runner: ModelRunner | None = None,
                 tokenizer: TextTokenizer | None = None) -> None:
        self.config = (config or Config()).validate()
        self.runner = runner or ModelRunner(self.config)
        self.tokenizer = tokenizer or load_tokenizer(self.runner.model_path, self.config.tokenizer.path,
                                                     kind=self.config.tokenizer.kind)
        info = self.runner.describe()
        self.config = fitted_to_worker(self.config, info.max_batch_size, info.num_blocks)  # unset keys: the worker's
        self.scheduler = Scheduler(self.config, min(self.config.max_num_blocks, info.num_blocks),
                                   tuple(info.eos_token_ids), min(self.config.max_model_len, info.max_position_embeddings))
        self._pending: dict[tuple[str, int], _Pending] = {}  # (request id, sample index)
        # Embedding requests: None until the step that ends it, then its pooled vector or why it has none.
        self._embeddings: dict[str, list[float] | ExecutionError | None] = {}
        self.default_pooling = default_pooling(self.config.serving.embedding.pooling, self.runner.model_path)
        self._ids = itertools.count()
        self.last_step_outputs = StepOutputs()  # tokens of the latest step (benchmarks time them)
        # The replicas' engine loop, never planning ahead: a local step is computed when it is received,
        # so there is nothing to overlap with.
        self._loop = EngineLoop(_RunnerExecutor(self), overlap=False)
        self._completed: list[CompletedRequest] = []  # those the step running now finished

    def submit_request(self, prompt: str | Sequence[int], params: GenerationParams | None = None,
                       request_id: str | None = None, chat: bool = False, cache_salt: str = "",
                       lora: str = "") -> str:
        """Queue a prompt (text, chat-formatted text or token ids); return its request id. `lora`: the name of
        an adapter of `lora_modules` to serve it with ("" = the base model).

        Raises ValidationError for bad input, like the gateway does (ModelNotFoundError: an unknown adapter).
        """
        request_id = request_id or f"engine-{next(self._ids)}"
        request = inference_pb2.GenerateRequest(request_id=request_id, params=(params or GenerationParams()).to_proto())
        if isinstance(prompt, str) and chat:
            request.chat.messages.add(role="user", content=prompt)
        elif isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.ids.extend(prompt)
        prepared = prepare(request, self.tokenizer, "", self.scheduler.max_model_len, request_id)
        slot = lora_slot(self.config.lora_modules, self.config.max_loras, lora)
        self.scheduler.add_request(request_id, prepared.prompt_token_ids, request.params,
                                   lora_cache_salt(cache_salt, lora), lora_slot=slot)
        for index in range(prepared.sampling.n):
            self._pending[(request_id, index)] = _Pending(
                prepared.prompt_token_ids, TextStream(self.tokenizer, prepared.prompt_token_ids, prepared.sampling))
        return request_id

    def submit_embedding(self, text: str | Sequence[int], pooling: str = "", request_id: str | None = None,
                         lora: str = "") -> str:
        """Queue one input (text, or token ids) for its embedding; it runs in the same steps as generation.
        `pooling`: last | mean | cls ("" = the model's default). The vector: `take_embedding` once it is done."""
        request_id = request_id or f"engine-{next(self._ids)}"
        request = inference_pb2.EmbedRequest()
        if isinstance(text, str):
            request.inputs.add(text=text)
        else:
            request.inputs.add().token_ids.ids.extend(text)
        ids = tokenize_inputs(request, self.tokenizer, self.scheduler.max_model_len)[0]
        slot = lora_slot(self.config.lora_modules, self.config.max_loras, lora)
        self.scheduler.add_request(request_id, ids, EMBEDDING_PARAMS, lora_cache_salt("", lora), lora_slot=slot,
                                   pooling=POOLING_BY_NAME[pooling] if pooling else self.default_pooling)
        self._embeddings[request_id] = None
        return request_id

    def take_embedding(self, request_id: str, dimensions: int = 0, normalize: bool = True) -> np.ndarray | None:
        """The embedding of a finished `submit_embedding` (its first `dimensions` values, L2-normalised when
        `normalize`, as the gateway answers); None while it runs. Raises ExecutionError when it ended without one
        (a failed step), ValidationError for `dimensions` over the hidden size."""
        pooled = self._embeddings.get(request_id)
        if pooled is None:
            return None
        del self._embeddings[request_id]
        if isinstance(pooled, ExecutionError):
            raise pooled
        return finish_vector(pooled, dimensions, normalize)

    def embed(self, inputs: Sequence[str | Sequence[int]], pooling: str = "", dimensions: int = 0,
              normalize: bool = True) -> list[np.ndarray]:
        """Embed every input (stepping the engine, with whatever else is queued, until they are done)."""
        ids = [self.submit_embedding(text, pooling) for text in inputs]
        while any(self._embeddings.get(i, 0) is None for i in ids) and self.has_pending_work():
            self.step()
        vectors = [self.take_embedding(i, dimensions, normalize) for i in ids]
        if any(v is None for v in vectors):  # aborted, or the engine suspended, before they were done
            raise ExecutionError("embedding requests ended before their vectors were computed")
        return vectors  # type: ignore[return-value]

    def abort(self, request_id: str) -> list[CompletedRequest]:
        self._embeddings.pop(request_id, None)
        if self.scheduler.abort(request_id):
            keys = [k for k in self._pending if k[0] == request_id]
            return [self._complete(k, common_pb2.FINISH_REASON_ABORT) for k in keys]
        return []

    def has_pending_work(self) -> bool:
        return self.scheduler.has_pending_work()

    def suspend(self, mode: str | None = None) -> int:
        """Pause after the current step and release the KV cache's memory as `mode` says
        (persist | offload | recompute; default: config.kv_cache_management_mode). Requests in
        flight stay queued and continue after `resume()`. Returns the bytes released."""
        mode = mode or self.config.kv_cache_management_mode
        if mode not in ("persist", "offload", "recompute"):
            raise ValidationError(f"suspend mode must be persist, offload or recompute (got {mode!r})")
        self.scheduler.suspend(mode)
        return self.runner.suspend_kv_cache(mode)

    def resume(self) -> None:
        self.runner.resume_kv_cache()
        self.scheduler.resume()

    def step(self) -> list[CompletedRequest]:
        """Run one engine step; return the requests that finished in it."""
        self._completed = []
        self._loop.step_now(self.scheduler)
        completed, self._completed = self._completed, []
        return completed

    def _take_outputs(self, outputs: StepOutputs) -> None:
        """A step's outputs: into the pending requests, the embeddings and `_completed`."""
        self.last_step_outputs = outputs
        completed = self._completed
        for out in outputs:
            if out.request_id in self._embeddings:  # its one output: the vector, or why there is none
                self._embeddings[out.request_id] = list(out.embedding) if out.embedding else ExecutionError(
                    out.error or f"embedding {out.request_id!r} ended ({finish_reason_name(out.finish_reason)})")
                continue
            key = (out.request_id, out.index)
            pending = self._pending[key]
            pending.output_token_ids.extend(out.token_ids)
            pending.cached_prompt_tokens = max(pending.cached_prompt_tokens, out.cached_prompt_tokens)
            delta = pending.stream.push(out.token_ids)
            pending.text += delta.text
            if delta.stopped:
                self.scheduler.abort(out.request_id, common_pb2.FINISH_REASON_STOP, index=out.index)
                completed.append(self._complete(key, common_pb2.FINISH_REASON_STOP))
            elif is_finished(out.finish_reason):
                pending.text += pending.stream.finish()
                completed.append(self._complete(key, out.finish_reason))

    def run(self) -> list[CompletedRequest]:
        """Step until every submitted request has finished; return them in completion order."""
        completed: list[CompletedRequest] = []
        while self.has_pending_work():
            completed.extend(self.step())
        return completed

    def get_memory_stats(self) -> MemoryStats:
        st = self.scheduler.pool_stats()
        return MemoryStats(st.total_blocks, st.used_blocks, st.free_blocks, len(self.scheduler.running),
                           cached_blocks=st.cached_blocks, prefix_cache_queries=st.prefix_cache_queries,
                           prefix_cache_hits=st.prefix_cache_hits, num_preemptions=st.num_preemptions,
                           num_swapped=st.num_swapped, internal_waste=st.internal_waste)

    def _complete(self, key: tuple[str, int], reason: int) -> CompletedRequest:
        p = self._pending.pop(key)
        return CompletedRequest(key[0], p.prompt_token_ids, p.output_token_ids, p.text, finish_reason_name(reason),
                                index=key[1], cached_prompt_tokens=p.cached_prompt_tokens)
