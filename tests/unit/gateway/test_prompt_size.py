"""A prompt that cannot fit is refused before it is tokenized (gateway/validation.py), and large
inputs are tokenized on the bounded tokenizer pool (gateway/text/tokenizer_pool.py)."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest

from gateway.limits import heap_trim
from gateway.limits.heap_trim import HeapTrimmer
from gateway.text.tokenizer_pool import INLINE_CHARS, TokenizerPool
from gateway.validation import prepare, refuse_unfitting
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.errors import OverloadedError, ValidationError
from hetero_common.model_files import default_model_path
from hetero_common.tokenizer import TextTokenizer, load_tokenizer
from tests.helpers.waiting import wait_until_async

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def smollm2() -> TextTokenizer:
    return load_tokenizer(default_model_path())


def request(prompt: str) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(prompt=prompt, params=common_pb2.SamplingParams(max_tokens=1))


def chat(*contents: str) -> inference_pb2.GenerateRequest:
    messages = [inference_pb2.ChatMessage(role="user" if i % 2 == 0 else "assistant", content=c)
                for i, c in enumerate(contents)]
    return inference_pb2.GenerateRequest(chat=inference_pb2.Chat(messages=messages),
                                         params=common_pb2.SamplingParams(max_tokens=1))


def counting(encode: Callable[..., list[int]], calls: list[int]) -> Callable[..., list[int]]:
    """The real `encode`, recording the length of each text it is given."""
    def recorded(text: str, *args: Any, **kwargs: Any) -> list[int]:
        calls.append(len(text))
        return encode(text, *args, **kwargs)
    return recorded


def test_a_prompt_that_cannot_fit_is_refused_at_once_with_a_lower_bound(smollm2: TextTokenizer,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """At once: without tokenizing it (seconds for 18 MB). Every call of the real tokenizer is counted."""
    text = "hello " * 3_000_000  # 18 MB
    encoded: list[int] = []
    monkeypatch.setattr(smollm2, "encode", counting(smollm2.encode, encoded))
    with pytest.raises(ValidationError) as refused:
        prepare(request(text), smollm2, "", MAX_MODEL_LEN, "r")
    monkeypatch.undo()
    assert encoded == []
    at_least = -(-len(text) // 81)  # SmolLM2's longest token: 81 characters
    assert refused.value.message == (f"prompt is at least {at_least} tokens; max_model_len is {MAX_MODEL_LEN} (prompt "
                                     "plus at least one generated token): shorten the prompt")
    assert at_least <= len(smollm2.encode(text[:810_000])) * (len(text) // 810_000)  # a true lower bound


def test_the_exact_message_where_the_text_might_fit(smollm2: TextTokenizer) -> None:
    text = "hello " * 5000  # under 2048 * 81 characters, but 5001 tokens: counted, and the count said
    assert len(smollm2.encode(text)) == 5001
    with pytest.raises(ValidationError, match=r"^prompt is 5001 tokens; max_model_len is 2048 \(prompt plus"):
        prepare(request(text), smollm2, "", MAX_MODEL_LEN, "r")


def test_a_prompt_that_fits_is_never_refused_by_the_check(smollm2: TextTokenizer) -> None:
    rng = random.Random(3)
    vocab = list(smollm2.tokenizer.get_vocab())
    longest = smollm2.decode([smollm2.tokenizer.token_to_id(max(vocab, key=len))], skip_special_tokens=False)
    pieces = [longest, "\x1d" * 200, "a", " ", "😀", "=" * 64]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4000)))
        tokens = len(smollm2.encode(text))
        if tokens < MAX_MODEL_LEN:
            refuse_unfitting(request(text), smollm2, MAX_MODEL_LEN)  # must not raise
            assert len(prepare(request(text), smollm2, "", MAX_MODEL_LEN, "r").prompt_token_ids) == tokens
    exact = longest * (MAX_MODEL_LEN - 2)  # BOS-free: MAX_MODEL_LEN - 2 tokens of 81 characters each
    refuse_unfitting(request(exact), smollm2, MAX_MODEL_LEN)


def test_chat_messages_are_summed(smollm2: TextTokenizer) -> None:
    half = "x" * (MAX_MODEL_LEN * 81 // 2 + 81)
    refuse_unfitting(chat(half), smollm2, MAX_MODEL_LEN)  # one half fits the check
    with pytest.raises(ValidationError, match="^prompt is at least"):
        refuse_unfitting(chat(half, "ok", half), smollm2, MAX_MODEL_LEN)
    refuse_unfitting(chat(" " * 10 * MAX_MODEL_LEN * 81), smollm2, MAX_MODEL_LEN)  # trimmed, as templates do


def test_small_inputs_run_inline_and_large_ones_on_a_worker() -> None:
    async def main() -> tuple[str, str]:
        pool = TokenizerPool(workers=1, queue=0, trimmer=HeapTrimmer())
        try:
            return (await pool.run(lambda: threading.current_thread().name, chars=10),
                    await pool.run(lambda: threading.current_thread().name, chars=INLINE_CHARS))
        finally:
            pool.close()

    inline, worker = asyncio.run(main())
    assert inline == threading.main_thread().name and worker.startswith("tokenizer")


def test_the_pool_refuses_when_full_and_recovers() -> None:
    release = threading.Event()

    async def main() -> None:
        pool = TokenizerPool(workers=1, queue=1, trimmer=HeapTrimmer())
        try:
            running = [asyncio.ensure_future(pool.run(release.wait, chars=INLINE_CHARS)) for _ in range(2)]
            await wait_until_async(lambda: pool.pending == 2, what="both large jobs taken by the pool (one running, "
                                   "one queued)", detail=lambda: f"{pool.pending} pending")
            with pytest.raises(OverloadedError, match="serving.tokenizer_workers"):
                await pool.run(release.wait, chars=INLINE_CHARS)
            assert await pool.run(lambda: 7, chars=1) == 7  # small inputs are not queued: still served
            release.set()
            assert await asyncio.gather(*running) == [True, True]
            await wait_until_async(lambda: pool.pending == 0, what="both finished jobs counted down",
                                   detail=lambda: f"{pool.pending} pending")
            assert await pool.run(lambda: 8, chars=INLINE_CHARS) == 8
        finally:
            release.set()
            pool.close()

    asyncio.run(main())


def test_a_cancelled_wait_still_counts_its_running_job() -> None:
    release, running = threading.Event(), threading.Event()

    def job() -> bool:
        running.set()
        return release.wait()

    async def main() -> None:
        pool = TokenizerPool(workers=1, queue=0, trimmer=HeapTrimmer())
        try:
            waiter = asyncio.ensure_future(pool.run(job, chars=INLINE_CHARS))
            # Running, not only submitted: a job still queued in the executor is cancelled with its wait.
            await wait_until_async(running.is_set, what="the large job running on the pool's worker")
            waiter.cancel()  # the client went away; the tokenization runs on
            with pytest.raises(asyncio.CancelledError):
                await waiter
            await asyncio.sleep(0.1)  # a negative: a count-down the cancel would wrongly cause has landed by now
            assert pool.pending == 1
            with pytest.raises(OverloadedError):
                await pool.run(release.wait, chars=INLINE_CHARS)
            release.set()
            await wait_until_async(lambda: pool.pending == 0, what="the finished job counted down",
                                   detail=lambda: f"{pool.pending} pending")
        finally:
            release.set()
            pool.close()

    asyncio.run(main())


@pytest.mark.skipif(heap_trim.MALLOC_TRIM is None, reason="glibc's malloc_trim only")
def test_a_large_input_during_a_pending_trim_gets_a_trim_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory a request frees after the trim that was due when it came is trimmed too."""
    monkeypatch.setattr(heap_trim, "TRIM_DELAY_S", 0.05)
    monkeypatch.setattr(heap_trim, "FOLLOW_UP_S", 3600.0)  # not this test's: its trims only

    async def main() -> tuple[int, int]:
        trimmer = HeapTrimmer()
        trimmer.release_later(heap_trim.TRIM_BYTES)
        trimmer.release_later(heap_trim.TRIM_BYTES)  # while the first trim is due
        trimmer.release_later(heap_trim.TRIM_BYTES - 1)  # small: no trim of its own
        await wait_until_async(lambda: trimmer.trims >= 2, what="the trim after the one that was due (for the "
                               "input that came meanwhile)", detail=lambda: f"{trimmer.trims} trims")
        await asyncio.sleep(0.3)  # a negative: no third (the small input has none; the follow-up is an hour off)
        first = trimmer.trims
        trimmer.release_later(heap_trim.TRIM_BYTES)
        await wait_until_async(lambda: trimmer.trims >= 3, what="the trim after a later large input",
                               detail=lambda: f"{trimmer.trims} trims")
        return first, trimmer.trims

    assert asyncio.run(main()) == (2, 3)


@pytest.mark.skipif(heap_trim.MALLOC_TRIM is None, reason="glibc's malloc_trim only")
def test_each_trim_is_followed_by_one_more_for_what_was_still_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap_trim, "TRIM_DELAY_S", 0.05)
    # Long enough that the first count is read before the follow-up ran, even on a loop that stalls.
    monkeypatch.setattr(heap_trim, "FOLLOW_UP_S", 0.5)

    async def main() -> tuple[int, int]:
        trimmer = HeapTrimmer()
        trimmer.release_later(heap_trim.TRIM_BYTES)
        await wait_until_async(lambda: trimmer.trims >= 1, interval=0.01, what="the trim after the large input")
        first = trimmer.trims
        await wait_until_async(lambda: trimmer.trims >= 2, what="the follow-up trim FOLLOW_UP_S after the first",
                               detail=lambda: f"{trimmer.trims} trims")
        await asyncio.sleep(2 * heap_trim.FOLLOW_UP_S)  # a negative: no third (the follow-up has none of its own)
        return first, trimmer.trims

    assert asyncio.run(main()) == (1, 2)


@pytest.mark.skipif(heap_trim.MALLOC_TRIM is None, reason="glibc's malloc_trim only")
def test_memory_no_request_path_reports_is_given_back_once_the_heap_grew(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch trims when the resident size grew TRIM_GROWTH_BYTES past the last trim's, whoever
    allocated it (here: 64 MiB of small buffers, freed but for every 64th, which pins the heap), and
    the trim gives memory back: glibc's malloc_trim returns 1 when it released some to the system."""
    monkeypatch.setattr(heap_trim, "WATCH_INTERVAL_S", 0.05)
    released: list[int] = []
    trim = heap_trim.MALLOC_TRIM
    monkeypatch.setattr(heap_trim, "MALLOC_TRIM", lambda: released.append(trim()))

    async def main() -> tuple[int, int]:
        trimmer = HeapTrimmer()
        watch = asyncio.create_task(trimmer.watch())
        await asyncio.sleep(0.2)
        quiet = trimmer.trims  # no growth, no trim
        buffers = [bytearray(64 * 1024) for _ in range(1024)]
        pinned = buffers[::64]
        del buffers
        try:  # the watch looks every 0.05 s
            await wait_until_async(lambda: trimmer.trims > quiet, interval=0.05,
                                   what="the watch's trim after the heap grew by 64 MiB")
        finally:
            watch.cancel()
        assert pinned
        return quiet, trimmer.trims

    quiet, trims = asyncio.run(main())
    assert quiet == 0 and trims >= 1
    assert released[0] == 1, released  # the first trim, the watch's: memory went back
