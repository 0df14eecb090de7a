"""Giving the gateway's freed heap memory back to the system (glibc's `malloc_trim`).

Reading, parsing or tokenizing megabytes allocates hundreds of megabytes (a body's chunks, the
tokenizer's encoding, the id list) that glibc's malloc keeps in its arenas after they are freed,
one arena per thread, so a refused 64 MiB body would leave the gateway that much larger for good.
Two triggers trim the heap, always off the event loop (a large heap takes milliseconds to walk):

- `release_later(size)`: a moment (`TRIM_DELAY_S`) after an input of `TRIM_BYTES` or more is
  done with, at most one trim due at a time (and one more after it when another came meanwhile).
- `watch()`: every `WATCH_INTERVAL_S`, when the resident size has grown `TRIM_GROWTH_BYTES` past
  what it was after the last trim. This catches what no request path sees: a message the gRPC
  core refused by its size, the rest of a refused HTTP body drained by the lingering close.
  Memory still in use is not freed by a trim; the floor then moves up to it, so a gateway that
  legitimately grows trims once per `TRIM_GROWTH_BYTES`, not every interval.

Each trim is followed by one more `FOLLOW_UP_S` later: what was still in use while it ran (the
slices of a message the gRPC core has just refused, freed a moment after the refusal) would
otherwise stay, and raise the floor the watch measures growth from."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import sys
from typing import Callable

TRIM_BYTES = 2**20  # inputs this large leave enough freed memory behind to trim after them
TRIM_DELAY_S = 1.0  # after the request is answered and its body dropped
WATCH_INTERVAL_S = 1.0
TRIM_GROWTH_BYTES = 16 * 2**20
FOLLOW_UP_S = 3.0


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
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident size (Linux), or None."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    def __init__(self) -> None:
        self._trim: asyncio.TimerHandle | asyncio.Future[None] | None = None  # a trim due or running
        self._again = False  # a large input came while one was: trim once more after it
        self._follow_up: asyncio.TimerHandle | None = None  # the trim due after the last one
        self._floor = resident_bytes()  # the resident size after the last trim
        self.trims = 0  # heap trims done (tests)

    def release_later(self, size: int) -> None:
        """After an input of `size` bytes (or characters): trim the heap in TRIM_DELAY_S. When a
        trim is due already, once more after it: what this input leaves may be freed only after
        that one ran."""
        if size < TRIM_BYTES or MALLOC_TRIM is None:
            return
        if self._trim is not None:
            self._again = True
            return
        self._trim = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._start_trim)

    async def watch(self) -> None:
        """Trim whenever the resident size grew TRIM_GROWTH_BYTES past the last trim's; until cancelled."""
        if MALLOC_TRIM is None:
            return
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            rss = resident_bytes()
            if self._trim is None and rss is not None and self._floor is not None and rss > self._floor + TRIM_GROWTH_BYTES:
                self._start_trim()

    def _start_trim(self, follow_up: bool = False) -> None:
        if self._follow_up is not None:  # this trim will have its own
            self._follow_up.cancel()
            self._follow_up = None
        # Off the loop, and outside the tokenizer pool (its workers are bounded and may be busy).
        self._trim = asyncio.get_running_loop().run_in_executor(None, self._trim_now)
        self._trim.add_done_callback(lambda _: self._trimmed(follow_up))

    def _trim_now(self) -> None:
        if MALLOC_TRIM is not None:
            MALLOC_TRIM()
        self.trims += 1
        self._floor = resident_bytes()

    def _trimmed(self, follow_up: bool) -> None:  # on the loop
        self._trim = None
        if self._again:
            self._again = False
            self.release_later(TRIM_BYTES)
        elif not follow_up:
            self._follow_up = asyncio.get_running_loop().call_later(FOLLOW_UP_S, self._start_trim, True)
