"""The command bridge backend: an external program answers a request instead of the engine.

The program runs once per request (once per sample when n > 1) as an argv list (never
through a shell), with the prompt in `HETERO_PROMPT` and the sampling parameters in
`HETERO_*` variables; its stdout is streamed back as text. What a misbehaving program can do
is bounded: it runs in its own process group, killed whole (grandchildren too) on a timeout,
an abort, the output cap, the client going away and the gateway stopping; it inherits only the
gateway variables named in `serving.backend.command_env`; at most `command_max_concurrent`
programs run at once; a non-zero exit is reported to the client by its exit status alone (the
tail of its stderr goes to the gateway's log, never to the client). Values that cannot go into
an environment (a prompt or stop strings over what Linux allows one variable, a NUL) are
refused with INVALID_ARGUMENT before any program starts.
`CommandBridgeBackend` puts the program behind the gateway's backend interface.
"""

from __future__ import annotations

import asyncio
import atexit
import codecs
import contextlib
import dataclasses
import errno
import os
import signal
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

import structlog

from gateway.backends.backend import EmbeddingCall, EmbeddingOutput, SampleOutput
from gateway.backends.bridge_requests import (
    bridge_environment,
    bridge_prompt,
    refuse_logits_controls,
    refuse_tools_and_constraints,
)
from gateway.validation import PreparedRequest
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.config import BackendConfig
from hetero_common.errors import (
    CommandBridgeError,
    CommandBridgeNotFoundError,
    DeadlineExceededError,
    ModelNotFoundError,
    OverloadedError,
    UnsupportedError,
    ValidationError,
)
from hetero_common.sampling import Sampling, sample_seed
from hetero_common.tenancy import client_id
from hetero_common.tokenizer import TextTokenizer

log = structlog.get_logger("gateway.backends.command_bridge")
STDERR_TAIL_BYTES = 4096  # what of a failing program's stderr the log keeps (its end: where the error usually is)
READ_CHUNK_BYTES = 4096
# After a kill: how long the pipes are read to their end and the program waited for. Only a
# process that left the group (setsid) can hold a pipe open longer; then we stop waiting.
KILL_GRACE_S = 2.0
STDERR_GRACE_S = 1.0  # after a normal exit: how long its stderr may take to close
_EXIT_POLL_S = (0.002, 0.05)  # the first and the longest pause while waiting for an exit (see _exited)
_RUNNING_GROUPS: set[int] = set()  # every bridge's running process groups, for the exit-time kill


@dataclass
class TextChunk:
    """A piece of a backend's answer; the last one has `finished` set (and `truncated` when cut,
    `aborted` when an Abort killed the program)."""

    text: str
    finished: bool = False
    truncated: bool = False
    aborted: bool = False


def kill_group(pgid: int) -> None:
    """SIGKILL the program's whole process group (it is its group's leader: start_new_session), so
    that what it started dies with it. A group already gone is no error."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


@atexit.register
def _kill_running_groups() -> None:
    """The gateway stopping with programs still running (a loop that ended without closing their
    streams): their groups are not left behind. Their own sessions no longer get our signals."""
    for pgid in list(_RUNNING_GROUPS):
        kill_group(pgid)


@dataclass
class _StderrTail:
    """The last STDERR_TAIL_BYTES of the program's stderr, read in the background: kept here rather
    than as the task's result, so that a stderr held open (by a process that left the group) still
    leaves what was read when we stop waiting."""

    stream: asyncio.StreamReader
    tail: bytes = b""
    task: asyncio.Task[None] | None = None

    def start(self) -> "_StderrTail":
        self.task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        while chunk := await self.stream.read(READ_CHUNK_BYTES):
            self.tail = (self.tail + chunk)[-STDERR_TAIL_BYTES:]

    async def text(self, wait_s: float) -> str:
        assert self.task is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.task), wait_s)
        return self.tail.decode("utf-8", errors="replace").strip()

    def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


@dataclass
class _ProgramRun:
    """One run of the program: its process (the leader of its own group), its stderr's tail, the
    decoder of its stdout (UTF-8 split across reads), its deadline (loop time), and whether its
    last chunk went out."""

    request_id: str
    process: asyncio.subprocess.Process
    stdout: asyncio.StreamReader
    stderr: _StderrTail
    deadline: float
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    finished: bool = False

    def remaining(self) -> float:
        return self.deadline - asyncio.get_running_loop().time()


class CommandBridge:
    name = "command_bridge"

    def __init__(self, backend: BackendConfig) -> None:
        assert backend.command is not None and backend.command.program
        self.program = backend.command.program
        self.args = list(backend.command.args)
        self.timeout_s = backend.command_timeout_s
        self.max_output_bytes = backend.command_max_output_bytes
        self.max_concurrent = backend.command_max_concurrent
        self.env_names = list(backend.command_env)
        # Held from before the program starts until it is reaped: a request beyond it waits, no process started.
        self.slots = asyncio.Semaphore(self.max_concurrent)
        self.processes: dict[str, asyncio.subprocess.Process] = {}  # request id -> its program running now
        self.aborted: set[str] = set()

    def abort(self, request_id: str, any_tenant: bool = False) -> bool:
        """Kill the request's program (`request_id`: its scoped id; with `any_tenant` a client id, in
        every tenant's namespace); its stream then ends with a chunk marked `aborted`."""
        ids = [i for i in self.processes if client_id(i) == request_id] if any_tenant else [request_id]
        found = False
        for rid in ids:
            process = self.processes.get(rid)
            if process is None:
                continue
            found = True
            self.aborted.add(rid)
            kill_group(process.pid)
        return found

    def kill_all(self) -> None:
        """Kill every program this bridge runs now (the gateway stopping); their streams then end."""
        for process in list(self.processes.values()):
            kill_group(process.pid)

    async def stream(self, request_id: str, prompt: str, sampling: Sampling, model: str,
                     index: int = 0, wait_s: float | None = None) -> AsyncIterator[TextChunk]:
        """The program's answer as it streams. `wait_s`: how long the request may wait for one of the
        command_max_concurrent slots (the client's remaining time; at most command_timeout_s)."""
        env = bridge_environment(request_id, prompt, sampling, model, index, self.env_names)  # refusals first
        async with self._slot(wait_s):
            run = await self._start(request_id, env)
            try:
                async with aclosing(self._output(run)) as chunks:
                    async for chunk in chunks:
                        run.finished = chunk.finished  # set before the yield: the client may stop at the last chunk
                        yield chunk
                if not run.finished:
                    last = await self._last_chunk(run)
                    run.finished = True
                    yield last
            except asyncio.TimeoutError:
                raise DeadlineExceededError(f"command bridge program {self.program!r} ran longer than "
                                            f"serving.backend.command_timeout_s ({self.timeout_s:g} s); raise it or "
                                            "fix the program") from None
            finally:
                await self._release(run)

    @contextlib.asynccontextmanager
    async def _slot(self, wait_s: float | None) -> AsyncIterator[None]:
        """One of the command_max_concurrent slots, waited for at most `wait_s` and command_timeout_s."""
        bound = self.timeout_s if wait_s is None else max(0.0, min(wait_s, self.timeout_s))
        try:
            await asyncio.wait_for(self.slots.acquire(), bound)
        except asyncio.TimeoutError:
            if wait_s is not None and wait_s < self.timeout_s:
                raise DeadlineExceededError(f"the request's deadline passed while it waited for one of the "
                                            f"{self.max_concurrent} command bridge programs "
                                            "(serving.backend.command_max_concurrent) to end") from None
            raise OverloadedError(f"all {self.max_concurrent} command bridge programs "
                                  f"(serving.backend.command_max_concurrent) stayed busy for {self.timeout_s:g} s "
                                  "(serving.backend.command_timeout_s); retry later") from None
        try:
            yield
        finally:
            self.slots.release()

    async def _start(self, request_id: str, env: dict[str, str]) -> _ProgramRun:
        """The program started in its own process group (so a kill reaches what it starts), its
        stderr read in the background, its deadline set."""
        try:
            process = await asyncio.create_subprocess_exec(
                self.program, *self.args, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            raise CommandBridgeNotFoundError(
                f"command bridge program {self.program!r} cannot be run ({exc.strerror or exc}); "
                "fix serving.backend.command.program") from exc
        except (OSError, ValueError) as exc:
            raise self._start_error(exc) from exc
        assert process.stdout is not None and process.stderr is not None
        _RUNNING_GROUPS.add(process.pid)
        self.processes[request_id] = process
        return _ProgramRun(request_id, process, process.stdout, _StderrTail(process.stderr).start(),
                           asyncio.get_running_loop().time() + self.timeout_s)

    def _start_error(self, exc: OSError | ValueError) -> CommandBridgeError:
        """exec's refusal, said as what to fix (the request's own values were checked before)."""
        log.error("bridge program cannot start", program=self.program, error=str(exc))
        if isinstance(exc, OSError) and exc.errno == errno.E2BIG:
            return CommandBridgeError("the command bridge program cannot be started: its arguments and environment are "
                                      "too large for exec (E2BIG); shorten serving.backend.command.args or the "
                                      "variables named in serving.backend.command_env")
        if isinstance(exc, ValueError):  # "embedded null byte", or an unencodable character
            return CommandBridgeError(f"the command bridge program cannot be started ({exc}); fix "
                                      "serving.backend.command (program, args) and serving.model_name")
        return CommandBridgeError(f"the command bridge program cannot be started ({exc.strerror or exc}); "
                                  "fix serving.backend.command")

    async def _output(self, run: _ProgramRun) -> AsyncIterator[TextChunk]:
        """The program's stdout as text until it ends, or until the output cap (that chunk is the
        last: finished and truncated). Raises asyncio.TimeoutError past the deadline."""
        written = 0
        while True:
            remaining = run.remaining()
            if remaining <= 0:
                raise asyncio.TimeoutError
            data = await asyncio.wait_for(run.stdout.read(READ_CHUNK_BYTES), remaining)
            if not data:
                return
            if written + len(data) > self.max_output_bytes:
                # A character cut by the cap is dropped, not replaced.
                text = run.decoder.decode(data[: self.max_output_bytes - written])
                log.warning("bridge output over the cap; program killed", max_output_bytes=self.max_output_bytes)
                yield TextChunk(text, finished=True, truncated=True)
                return
            written += len(data)
            text = run.decoder.decode(data)
            if text:
                yield TextChunk(text)

    async def _last_chunk(self, run: _ProgramRun) -> TextChunk:
        """After stdout's end: the program's exit. An Abort's kill ends the stream `aborted`; any
        other non-zero exit is an error naming the exit status only (the stderr tail is logged)."""
        code = await self._exited(run.process, max(0.1, run.remaining()))
        kill_group(run.process.pid)  # what it left running in the background ends with the request
        if run.request_id in self.aborted:
            return TextChunk(run.decoder.decode(b"", final=True), finished=True, aborted=True)
        if code != 0:
            tail = await run.stderr.text(STDERR_GRACE_S)
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            log.warning("bridge program failed", program=self.program, exit_code=code, stderr_tail=tail or "(empty)")
            raise CommandBridgeError(f"the command bridge program {how}; its stderr is in the gateway's log")
        return TextChunk(run.decoder.decode(b"", final=True), finished=True)

    @staticmethod
    async def _exited(process: asyncio.subprocess.Process, wait_s: float) -> int:
        """The program's exit status, once it exits (asyncio.TimeoutError after `wait_s`). Polled:
        Process.wait() also waits for every pipe to close, which a grandchild still holding stderr
        would put off until the deadline."""
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + wait_s, _EXIT_POLL_S[0]
        while process.returncode is None:
            if loop.time() >= deadline:
                raise asyncio.TimeoutError
            await asyncio.sleep(pause)
            pause = min(pause * 2, _EXIT_POLL_S[1])
        return process.returncode

    async def _release(self, run: _ProgramRun) -> None:
        """Forget the run; kill the program's group (timeout, output cap, the client went away, or
        stragglers after its exit) and reap it, waiting a bounded time for its pipes to close."""
        self.processes.pop(run.request_id, None)
        self.aborted.discard(run.request_id)
        kill_group(run.process.pid)
        try:
            await asyncio.wait_for(self._drain_and_reap(run), KILL_GRACE_S)
        except asyncio.TimeoutError:
            # Only a process that left the group holds a pipe this long: stop reading it (closing the
            # transport closes our ends of the pipes; the child watcher reaps the killed program itself).
            log.warning("bridge program's pipes still open after the kill; a process left its group",
                        pid=run.process.pid)
            transport = getattr(run.process, "_transport", None)
            if transport is not None:
                transport.close()
        finally:
            _RUNNING_GROUPS.discard(run.process.pid)
            run.stderr.stop()
        if not run.finished:
            log.info("bridge request ended early", pid=run.process.pid)

    @staticmethod
    async def _drain_and_reap(run: _ProgramRun) -> None:
        # Read stdout to its end: a pipe whose reading is paused (a full buffer) never reports EOF,
        # and Process.wait() waits for every pipe to close (stderr is read by its own task).
        while await run.stdout.read(READ_CHUNK_BYTES):
            pass
        await run.process.wait()


class CommandBridgeBackend:
    """The program's text as responses marked backend="command_bridge". With n > 1 the program
    runs once per sample, one after another, each with the sample's seed (as the engine derives
    it) and HETERO_SAMPLE_INDEX. Stop strings are the program's to honour (HETERO_STOP). A
    request waits for a free bridge slot at most until its deadline."""

    def __init__(self, bridge: CommandBridge, tokenizer: TextTokenizer, model_name: str) -> None:
        self.bridge = bridge
        self.tokenizer = tokenizer
        self.model_name = model_name

    async def max_model_len(self) -> int | None:
        return None  # the program's model is its own business

    async def server_info(self) -> inference_pb2.ServerInfo:
        return inference_pb2.ServerInfo(backend=self.bridge.name)

    async def model_facts(self) -> inference_pb2.ModelCard:
        return inference_pb2.ModelCard()  # the program's model is its own business

    async def abort(self, request_id: str, any_tenant: bool = False) -> bool:
        return self.bridge.abort(request_id, any_tenant)

    def stop(self) -> None:
        self.bridge.kill_all()  # programs still running past the grace die with the gateway

    serves_lora = False

    async def lora_adapters(self) -> list[common_pb2.LoraAdapter]:
        return []

    async def load_lora_adapter(self, request: common_pb2.LoadLoraAdapterRequest,
                                timeout: float | None) -> common_pb2.LoraAdapter:
        raise ValidationError("the command_bridge backend serves no LoRA adapters (serving.backend.kind: scheduler does)")

    async def unload_lora_adapter(self, request: common_pb2.UnloadLoraAdapterRequest,
                                  timeout: float | None) -> common_pb2.UnloadLoraAdapterResponse:
        raise ModelNotFoundError(f"no LoRA adapter named {request.name!r} is loaded: the command_bridge backend "
                                 "serves none", "name")

    async def embed(self, call: EmbeddingCall, timeout: float | None) -> EmbeddingOutput:
        raise UnsupportedError("the command_bridge backend computes no embeddings (serving.backend.kind: scheduler does)")

    async def generate(self, request: inference_pb2.GenerateRequest, prepared: PreparedRequest,
                       timeout: float | None) -> AsyncIterator[SampleOutput]:
        # `timeout` bounds only the wait for a bridge slot: serving.backend.command_timeout_s bounds each run.
        if request.params.HasField("prompt_logprobs"):  # a program answers in text: it has no logits
            raise ValidationError("params.prompt_logprobs is not served by the command_bridge backend")
        refuse_logits_controls(prepared.sampling)
        refuse_tools_and_constraints(request)
        if prepared.adapter:
            raise ValidationError(f"model {prepared.adapter!r} is a LoRA adapter, which the command_bridge backend "
                                  "does not serve", "model")
        prompt, sampling = bridge_prompt(request, self.tokenizer), prepared.sampling
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout  # the client's, across its samples
        for index in range(sampling.n):
            if index and sampling.seed is not None:
                sampling = dataclasses.replace(prepared.sampling, seed=sample_seed(prepared.sampling.seed, index))
            text: list[str] = []
            wait_s = None if deadline is None else deadline - loop.time()
            # aclosing: a client that goes away closes this stream, and the program is killed then, not at GC.
            async with aclosing(self.bridge.stream(prepared.scoped_id, prompt, sampling, self.model_name, index,
                                                   wait_s)) as chunks:
                async for chunk in chunks:
                    text.append(chunk.text)
                    response = inference_pb2.GenerateResponse(request_id=prepared.request_id, text=chunk.text,
                                                              index=index, model=self.model_name,
                                                              backend=self.bridge.name)
                    tokens = 0
                    if chunk.finished:  # the program's text has no token ids: count the sample's by encoding it
                        response.finish_reason = (common_pb2.FINISH_REASON_ABORT if chunk.aborted else
                                                  common_pb2.FINISH_REASON_LENGTH if chunk.truncated
                                                  else common_pb2.FINISH_REASON_STOP)
                        tokens = len(self.tokenizer.encode("".join(text), add_special_tokens=False))
                    yield SampleOutput(response, tokens)
                    if chunk.aborted:  # the request's later samples are aborted too
                        for later in range(index + 1, sampling.n):
                            yield SampleOutput(inference_pb2.GenerateResponse(
                                request_id=prepared.request_id, index=later, model=self.model_name,
                                backend=self.bridge.name, finish_reason=common_pb2.FINISH_REASON_ABORT))
                        return
