"""Waiting for something to happen, instead of sleeping a fixed time and asserting it did.

On a shared, loaded 2-core machine a fixed sleep is too short by turns: the server has not yet
accepted the connections, the worker thread has not yet run, the timer fired late. A test waits
until the condition holds instead, polling it every `interval` seconds, with `timeout` only as a
hang guard (many times what it takes on an idle machine): when it passes, the test fails with a
message naming what never happened.

    wait_until(lambda: pool(stack).num_running > 1, what="two long requests decoding together")
    await wait_until_async(lambda: trimmer.trims >= 1, what="the trim after the large input")

A negative (something must NOT happen) cannot be polled: it keeps its sleep, and the positive
control after it is polled with these."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

HANG_GUARD_S = 30.0  # a wait that has not ended by then hangs: each use ends in milliseconds when idle


def _never(what: str, timeout: float, detail: Callable[[], Any] | None) -> AssertionError:
    state = f"; last seen: {detail()}" if detail is not None else ""
    return AssertionError(f"never happened within the {timeout:g} s hang guard: {what}{state}")


def wait_until(predicate: Callable[[], T], timeout: float = HANG_GUARD_S, interval: float = 0.02,
               what: str = "the condition", detail: Callable[[], Any] | None = None) -> T:
    """Poll `predicate()` until it returns something true, and return that. Fails with an
    AssertionError naming `what` (and `detail()`, the state seen last) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _never(what, timeout, detail)
        time.sleep(interval)


async def wait_until_async(predicate: Callable[[], T | Awaitable[T]], timeout: float = HANG_GUARD_S,
                           interval: float = 0.02, what: str = "the condition",
                           detail: Callable[[], Any] | None = None) -> T:
    """`wait_until` on an event loop: sleeps with `asyncio.sleep`, so what the loop runs goes on
    meanwhile. `predicate` may be a coroutine function."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if loop.time() > deadline:
            raise _never(what, timeout, detail)
        await asyncio.sleep(interval)
