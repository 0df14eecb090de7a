"""The gateway's tokenizer pool: tokenizing and chat templating of large inputs run on a few worker
threads, off the event loop, so that a large request delays only itself.

Small inputs (under `INLINE_CHARS` characters, a few milliseconds of work) are done inline: a
thread hand-off would cost more than it saves, and they never wait behind large ones. Large ones
(and constrained requests, whose grammar compiles for up to a second) go to the pool. The
tokenizer releases the GIL while it tokenizes (`TextTokenizer.encode`); Jinja rendering and the
Python around it hold it, but a worker thread yields it to the loop every switch interval (5 ms).

Memory: a large input leaves freed memory behind; the pool tells the gateway's `HeapTrimmer`
(`heap_trim.py`) when one is done with, and the trimmer gives it back to the system.

Bounded: at most `workers` jobs run and `queue` more wait; past that a request is refused with
OverloadedError (gRPC RESOURCE_EXHAUSTED, HTTP 429) instead of queueing ever more text in memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import Any, Callable, TypeVar

from gateway.limits.heap_trim import HeapTrimmer
from hetero_common.errors import OverloadedError

T = TypeVar("T")

# Inputs shorter than this many characters are tokenized on the loop: ~5 ms for SmolLM2's tokenizer.
INLINE_CHARS = 8192


class TokenizerPool:
    def __init__(self, workers: int, queue: int, trimmer: HeapTrimmer) -> None:
        self.workers = workers
        self.trimmer = trimmer
        self.queue = queue
        self.pending = 0  # jobs submitted and not finished (running or waiting); touched on the loop only
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenizer")

    async def run(self, fn: Callable[..., T], *args: Any, chars: int = INLINE_CHARS, **kwargs: Any) -> T:
        """fn(*args, **kwargs): inline when `chars` (the size of the input it tokenizes) is under
        INLINE_CHARS, else on a worker thread; refused when `workers + queue` jobs are pending."""
        if chars < INLINE_CHARS:
            return fn(*args, **kwargs)
        if self.pending >= self.workers + self.queue:
            raise OverloadedError(f"the gateway is tokenizing {self.pending} large inputs, its limit "
                                  "(serving.tokenizer_workers running plus serving.tokenizer_queue waiting); retry later")
        loop = asyncio.get_running_loop()
        future = self._executor.submit(functools.partial(fn, *args, **kwargs))
        self.pending += 1
        # Counted until the job ends, not until its caller stops waiting: a client that goes away
        # does not stop a tokenization already running.
        future.add_done_callback(lambda _: self._finished(loop, chars))
        return await asyncio.wrap_future(future)

    def _finished(self, loop: asyncio.AbstractEventLoop, chars: int) -> None:
        try:
            loop.call_soon_threadsafe(self._count_down, chars)
        except RuntimeError:  # the loop has closed: nobody counts any more
            pass

    def _count_down(self, chars: int) -> None:
        self.pending -= 1
        self.trimmer.release_later(chars)  # what the job allocated is freed now

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
