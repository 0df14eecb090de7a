"""The in-process engine: the same Scheduler and ModelRunner as the services, without gRPC.

    engine = InferenceEngine(config)
    rid = engine.submit_request("Hello, world!", GenerationParams(max_tokens=50))
    for result in engine.run():
        print(result.request_id, result.output_text)

Tests and embedders use it; the step plans and results are the same protobuf messages the
services exchange, so both paths run the same code.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from gateway.requests import prepare
from gateway.text_stream import TextStream
from gateway.tokenizer import TextTokenizer, load_tokenizer
from gpu_worker.runner import ModelRunner
from hetero.v1 import common_pb2, inference_pb2
from hetero_infer.config import Config
from scheduler_svc.scheduler import Scheduler


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

    def to_proto(self) -> common_pb2.SamplingParams:
        p = common_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                      top_k=self.top_k, stop=self.stop, stop_token_ids=self.stop_token_ids,
                                      ignore_eos=self.ignore_eos)
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

    @property
    def generated_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass
class MemoryStats:
    total_blocks: int
    used_blocks: int
    free_blocks: int
    num_sequences: int


@dataclass
class _Pending:
    prompt_token_ids: list[int]
    stream: TextStream
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""


_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
            common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_ERROR: "error"}


class InferenceEngine:
    def __init__(self, config: Config | None = None, runner: ModelRunner | None = None,
                 tokenizer: TextTokenizer | None = None) -> None:
        self.config = (config or Config()).validate()
        self.runner = runner or ModelRunner(self.config)
        self.tokenizer = tokenizer or load_tokenizer(self.runner.model_path, self.config.tokenizer.path)
        info = self.runner.describe()
        self.scheduler = Scheduler(self.config, min(self.config.max_num_blocks, info.num_blocks),
                                   tuple(info.eos_token_ids), min(self.config.max_model_len, info.max_position_embeddings))
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()

    def submit_request(self, prompt: str | Sequence[int], params: GenerationParams | None = None,
                       request_id: str | None = None, chat: bool = False) -> str:
        """Queue a prompt (text, chat-formatted text or token ids); return its request id.

        Raises ValidationError for bad input, like the gateway does.
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
        self.scheduler.add_request(request_id, prepared.prompt_token_ids, request.params)
        self._pending[request_id] = _Pending(prepared.prompt_token_ids,
                                             TextStream(self.tokenizer, prepared.prompt_token_ids, prepared.sampling))
        return request_id

    def abort(self, request_id: str) -> list[CompletedRequest]:
        if self.scheduler.abort(request_id):
            return [self._complete(request_id, common_pb2.FINISH_REASON_ABORT)]
        return []

    def has_pending_work(self) -> bool:
        return self.scheduler.has_pending_work()

    def step(self) -> list[CompletedRequest]:
        """Run one engine step; return the requests that finished in it."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        result = self.runner.execute(plan)
        completed = []
        for out in self.scheduler.process_result(result):
            pending = self._pending[out.request_id]
            pending.output_token_ids.extend(out.token_ids)
            delta = pending.stream.push(out.token_ids)
            pending.text += delta.text
            if delta.stopped:
                self.scheduler.abort(out.request_id, common_pb2.FINISH_REASON_STOP)
                completed.append(self._complete(out.request_id, common_pb2.FINISH_REASON_STOP))
            elif out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                pending.text += pending.stream.finish()
                completed.append(self._complete(out.request_id, out.finish_reason))
        return completed

    def run(self) -> list[CompletedRequest]:
        """Step until every submitted request has finished; return them in completion order."""
        completed: list[CompletedRequest] = []
        while self.has_pending_work():
            completed.extend(self.step())
        return completed

    def get_memory_stats(self) -> MemoryStats:
        pool = self.scheduler.pool
        return MemoryStats(pool.num_blocks, pool.num_used, pool.num_free, len(self.scheduler.running))

    def _complete(self, request_id: str, reason: int) -> CompletedRequest:
        p = self._pending.pop(request_id)
        return CompletedRequest(request_id, p.prompt_token_ids, p.output_token_ids, p.text, _REASONS[reason])
