"""A large Tokenize keeps the gateway's event loop free (gateway/text/tokenizer_pool.py, gateway/text/tokenization.py):
the input is tokenized on a tokenizer thread, and the answer (every id and its token's text) is built and
serialized there too, in pieces, so that no single call holding the GIL covers the whole answer; the
heap is trimmed after it. Checked on the real gRPC server and HTTP app, in-process, with a recording
wrapper around each real step: what ran on which thread, and how much each serialization covered.
tests/stack/test_tokenize_off_loop.py sends a 4 MiB one through the real stack."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.backends.command_bridge import CommandBridge, CommandBridgeBackend
from gateway.generation import Generation
from gateway.grpc import grpc_api
from gateway.grpc.grpc_api import InferenceServicer, add_inference_servicer
from gateway.limits import heap_trim
from gateway.text import tokenization
from gateway.text.tokenizer_pool import INLINE_CHARS
from gateway.text.chat import render_chat
from hetero.v1 import inference_pb2, inference_pb2_grpc
from hetero_common.config import BackendConfig, CommandConfig, Config
from hetero_common.tokenizer import TextTokenizer, load_tokenizer
from hetero_infer.bench.harness import make_tokenizer
from tests.helpers.http_app import bridge_http_client

# 216k ids with the tiny tokenizer (13 pieces of tokenization.CHUNK), far over INLINE_CHARS.
LARGE = " ".join(["alpha", "bravo", "delta", "echo", "golf", "kilo"] * 8_000)
HANG_GUARD_S = 60  # a call that has not ended by then hangs (it takes well under a second)


@pytest.fixture
def tokenizer(tmp_path: Path) -> TextTokenizer:
    make_tokenizer(tmp_path)
    return load_tokenizer(tmp_path)


def on_pool(thread_name: str) -> bool:
    return thread_name.startswith("tokenizer")  # TokenizerPool's thread_name_prefix


def recording(fn: Callable[..., Any], calls: list[Any], what: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, which also records, per call, the name of the thread it ran on and `what(*args)`."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append((threading.current_thread().name, what(*args)))
        return fn(*args, **kwargs)
    return wrapper


def grpc_tokenize(tokenizer: TextTokenizer, request: inference_pb2.TokenizeRequest) -> inference_pb2.TokenizeResponse:
    """`request` through the gateway's real servicer, registered as the gateway registers it, on a real server."""
    generation = Generation(Config(), tokenizer, CommandBridgeBackend(
        CommandBridge(BackendConfig(kind="command_bridge", command=CommandConfig("/bin/echo"))), tokenizer, "tiny"))

    async def main() -> inference_pb2.TokenizeResponse:
        server = grpc.aio.server()
        add_inference_servicer(InferenceServicer(generation), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            options = [("grpc.max_receive_message_length", 64 * 2**20)]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
                return await inference_pb2_grpc.InferenceStub(channel).Tokenize(request, timeout=HANG_GUARD_S)
        finally:
            await server.stop(None)
            generation.tokenizer_pool.close()

    return asyncio.run(main())


def expected_answer(tokenizer: TextTokenizer, text: str) -> inference_pb2.TokenizeResponse:
    ids = tokenizer.encode(text)
    return inference_pb2.TokenizeResponse(count=len(ids), max_model_len=Config().max_model_len, token_ids=ids,
                                          tokens=tokenization.token_strings(tokenizer, ids))


def test_a_large_grpc_tokenize_is_tokenized_and_serialized_on_a_tokenizer_thread_in_pieces(
        tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """grpc.aio serializes a returned message on the event loop, holding the GIL throughout (tens of
    milliseconds and more for an answer of this size, every other client waiting): every serialization
    of a TokenizeResponse, whoever makes it, is recorded with its thread and its size."""
    encoded: list[Any] = []
    serialized: list[Any] = []
    monkeypatch.setattr(tokenizer, "encode", recording(tokenizer.encode, encoded, lambda text, *_: len(text)))
    monkeypatch.setattr(inference_pb2.TokenizeResponse, "SerializeToString", recording(
        inference_pb2.TokenizeResponse.SerializeToString, serialized, lambda message: len(message.token_ids)))
    answer = grpc_tokenize(tokenizer, inference_pb2.TokenizeRequest(text=LARGE))
    monkeypatch.undo()
    assert answer == expected_answer(tokenizer, LARGE)
    assert answer.count > 8 * tokenization.CHUNK, answer.count  # so that the answer comes in pieces
    assert [(on_pool(thread), chars) for thread, chars in encoded] == [(True, len(LARGE))]
    assert all(on_pool(thread) for thread, _ in serialized), serialized  # none on the loop
    assert max(ids for _, ids in serialized) <= tokenization.CHUNK  # the GIL held for a piece at a time
    assert sum(ids for _, ids in serialized) == answer.count  # nothing serialized twice, nothing elsewhere


def test_a_small_grpc_tokenize_is_answered_inline(tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[Any] = []
    monkeypatch.setattr(tokenizer, "encode", recording(tokenizer.encode, encoded, lambda text, *_: len(text)))
    answer = grpc_tokenize(tokenizer, inference_pb2.TokenizeRequest(text="hello world"))
    monkeypatch.undo()
    assert answer == expected_answer(tokenizer, "hello world")
    # Under INLINE_CHARS: on the loop (a thread hand-off would cost more than the work).
    assert encoded == [(threading.main_thread().name, len("hello world"))]
    assert len("hello world") < INLINE_CHARS <= len(LARGE)


def test_the_grpc_tokenize_answer_is_sent_as_serialized(tokenizer: TextTokenizer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """What gRPC's serializer gets on the loop is bytes already: it only hands them on."""
    given: list[Any] = []
    monkeypatch.setattr(grpc_api, "sent_as_serialized", recording(
        grpc_api.sent_as_serialized, given, lambda answer: type(answer)))
    answer = grpc_tokenize(tokenizer, inference_pb2.TokenizeRequest(text=LARGE))
    assert given == [(threading.main_thread().name, bytes)]  # asyncio.run's loop: this thread
    assert answer.count == len(answer.token_ids) == len(answer.tokens)


@pytest.mark.parametrize("kind", ["text", "text, no special tokens", "chat"])
def test_the_answer_in_pieces_parses_as_the_whole_message(tokenizer: TextTokenizer, kind: str) -> None:
    """Concatenated, the pieces are the message: its scalar fields once, its repeated ones in order."""
    chat = inference_pb2.Chat(messages=[inference_pb2.ChatMessage(role="user", content=LARGE)])
    request = {"text": inference_pb2.TokenizeRequest(text=LARGE),
               "text, no special tokens": inference_pb2.TokenizeRequest(text=LARGE, add_special_tokens=False),
               "chat": inference_pb2.TokenizeRequest(chat=chat)}[kind]
    ids = (tokenizer.encode(render_chat(tokenizer, chat), add_special_tokens=False) if kind == "chat"
           else tokenizer.encode(LARGE, add_special_tokens=kind == "text"))
    whole = inference_pb2.TokenizeResponse(count=len(ids), max_model_len=512, token_ids=ids,
                                           tokens=tokenization.token_strings(tokenizer, ids))
    assert inference_pb2.TokenizeResponse.FromString(tokenization.tokenize_answer(tokenizer, request, 512)) == whole
    assert len(ids) > tokenization.CHUNK


def test_a_refused_grpc_tokenize_gets_its_status(tokenizer: TextTokenizer) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        grpc_tokenize(tokenizer, inference_pb2.TokenizeRequest(text="hi", model="another-model"))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value.details()


def test_a_large_http_tokenize_is_tokenized_and_rendered_on_a_tokenizer_thread(
        tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[Any] = []
    rendered: list[Any] = []
    monkeypatch.setattr(tokenizer, "encode", recording(tokenizer.encode, encoded, lambda text, *_: len(text)))
    monkeypatch.setattr(tokenization, "json_bytes", recording(
        tokenization.json_bytes, rendered, lambda answer: answer["count"]))
    with bridge_http_client(tokenizer, max_model_len=512) as client:
        answer = client.post("/tokenize", json={"prompt": LARGE, "return_token_strs": True})
    monkeypatch.undo()
    assert answer.status_code == 200, answer.text
    expected = expected_answer(tokenizer, LARGE)
    body = answer.json()
    assert (body["count"], body["tokens"], body["token_strs"]) == (expected.count, list(expected.token_ids),
                                                                   list(expected.tokens))
    assert [(on_pool(thread), chars) for thread, chars in encoded] == [(True, len(LARGE))]
    assert [(on_pool(thread), count) for thread, count in rendered] == [(True, expected.count)]


@pytest.mark.skipif(heap_trim.MALLOC_TRIM is None, reason="glibc's malloc_trim only")
def test_the_heap_is_trimmed_after_a_large_tokenize(tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory a large input leaves behind is given back: the pool asks for a trim once the job is
    done, and the trim (glibc's malloc_trim, off the loop) runs."""
    trims: list[Any] = []
    monkeypatch.setattr(heap_trim, "TRIM_DELAY_S", 0.0)
    monkeypatch.setattr(heap_trim, "MALLOC_TRIM", recording(heap_trim.MALLOC_TRIM, trims, lambda: None))
    generation = Generation(Config(), tokenizer, CommandBridgeBackend(
        CommandBridge(BackendConfig(kind="command_bridge", command=CommandConfig("/bin/echo"))), tokenizer, "tiny"))

    async def main() -> int:
        pool = generation.tokenizer_pool
        request = inference_pb2.TokenizeRequest(text=LARGE)
        await pool.run(tokenization.tokenize_answer, tokenizer, request, 512, chars=len(LARGE))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HANG_GUARD_S
        while pool.trimmer.trims == 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return pool.trimmer.trims

    monkeypatch.setattr(heap_trim, "TRIM_BYTES", len(LARGE))  # this input is a large one
    try:
        assert asyncio.run(main()) >= 1
    finally:
        generation.tokenizer_pool.close()
    # Off the loop, and outside the tokenizer pool (its workers are bounded and may be busy).
    assert trims and all(thread != threading.main_thread().name and not on_pool(thread) for thread, _ in trims)
