"""A child of `hetero-infer serve` ends with its parent.

The child asks for it itself, first thing, instead of `serve` doing it in a `preexec_fn`:
a `preexec_fn` makes `subprocess` fork() a process whose gRPC event-engine threads are
running, and gRPC's fork handlers then abort the child now and then (seen under CPU load as
`pthread_create failed` / `epoll_wait error: Bad file descriptor`, the service exiting with
SIGABRT before it starts). Without one, `subprocess` uses vfork + exec, which runs no fork
handlers.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> bool:
    """Have the kernel send SIGTERM when the parent exits. False when it has already gone
    (we were re-parented before the request took effect)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the supervisor's own signal handling still stops its children
    return os.getppid() == parent_pid
