"""The gateway's tokenizer pool: tokenizing and chat templating of large inputs run on a few worker
threads, off the event loop, so that a large request delays only itself.

Small inputs (under `INLINE_CHARS` characters, a few milliseconds of work) are done inline: a
thread hand-off would cost more than it saves, and they never wait behind large ones. Large ones
(and constrained requests, whose grammar compiles for up to a second) go to the pool. The
tokenizer releases the GIL while it tokenizes (`TextTokenizer.encode`); Jinja rendering and the
Python around it hold it, but a worker thread yields it to the loop every switch interval (5 ms).

Memory: tokenizing megabytes allocates hundreds of megabytes (the tokenizer's encoding, the id
list) that glibc's malloc keeps in its arenas after they are freed, one arena per thread. A
moment after a large input is done with (`release_later`), the gateway hands free heap memory back
to the system (`malloc_trim`), at most once per `TRIM_DELAY_S`.

Bounded: at most `workers` jobs run and `queue` more wait; past that a request is refused with
OverloadedError (gRPC RESOURCE_EXHAUSTED, HTTP 429) instead of queueing ever more text in memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import functools
import sys
from typing import Any, Callable, TypeVar

from hetero_common.errors import OverloadedError

T = TypeVar("T")

# Inputs shorter than this many characters are tokenized on the loop: ~5 ms for SmolLM2's tokenizer.
INLINE_CHARS = 8192
TRIM_CHARS = 2**20  # inputs this large leave enough freed memory behind to trim the heap after them
TRIM_DELAY_S = 1.0  # after the request is answered and its body dropped


def _malloc_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0), or None elsewhere (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


MALLOC_TRIM = _malloc_trim()


class TokenizerPool:
    def __init__(self, workers: int, queue: int) -> None:
        self.workers = workers
        self.queue = queue
        self.pending = 0  # jobs submitted and not finished (running or waiting); touched on the loop only
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenizer")
        self._trim: asyncio.TimerHandle | None = None  # a trim due or running
        self._again = False  # a large input came while one was: trim once more after it
        self.trims = 0  # heap trims done (tests)

    async def run(self, fn: Callable[..., T], *args: Any, chars: int = INLINE_CHARS, **kwargs: Any) -> T:
        """fn(*args, **kwargs): inline when `chars` (the size of the input it tokenizes) is under
        INLINE_CHARS, else on a worker thread; refused when `workers + queue` jobs are pending."""
        self.release_later(chars)
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

    def release_later(self, chars: int) -> None:
        """After an input of `chars` characters: trim the heap in TRIM_DELAY_S. When a trim is due
        already, once more after it: what this input leaves may be freed only after that one ran."""
        if chars < TRIM_CHARS or MALLOC_TRIM is None:
            return
        if self._trim is not None:
            self._again = True
            return
        self._trim = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._start_trim)

    def _start_trim(self) -> None:
        # Off the loop (a large heap takes milliseconds to walk), and outside the bounded pool.
        asyncio.get_running_loop().run_in_executor(None, self._trim_now).add_done_callback(self._trimmed)

    def _trim_now(self) -> None:
        if MALLOC_TRIM is not None:
            MALLOC_TRIM()
        self.trims += 1

    def _trimmed(self, _: object) -> None:  # on the loop
        self._trim = None
        if self._again:
            self._again = False
            self.release_later(TRIM_CHARS)

    def _finished(self, loop: asyncio.AbstractEventLoop, chars: int) -> None:
        try:
            loop.call_soon_threadsafe(self._count_down, chars)
        except RuntimeError:  # the loop has closed: nobody counts any more
            pass

    def _count_down(self, chars: int) -> None:
        self.pending -= 1
        self.release_later(chars)  # what the job allocated is freed now

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
