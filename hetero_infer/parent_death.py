"""A child of `hetero-infer serve` ends with its parent.

The child asks for it itself, first thing, instead of `serve` doing it in a `preexec_fn`:
a `preexec_fn` makes `subprocess` fork() a process whose gRPC event-engine threads are
running, and gRPC's fork handlers then abort the child now and then (seen under CPU load as
`pthread_create failed` / `epoll_wait error: Bad file descriptor`, the service exiting with
SIGABRT before it starts). Without one, `subprocess` uses vfork + exec, which runs no fork
handlers.

The SIGTERM starts the service's own drain, which is bounded only as long as everything it
waits for ends. With `serve` alive, `serve` SIGKILLs a service that has not stopped in time
(supervisor.stop_grace_s); with `serve` gone nobody would, and one that hangs in its drain (a
worker's SIGTERM handler could deadlock on its queue's lock: see gpu_worker/service.py) would
live on as an orphan. So a watchdog thread does what `serve` would have done: the process exits
`exit_within_s` after the parent died, whatever it still waits for. A stack going down has
nobody to drain for but the service's own in-flight clients, which drain_grace_s covers.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5  # how often a Python or kernel without pidfd looks for the parent


def die_with_parent(parent_pid: int, exit_within_s: float) -> bool:
    """Have the kernel send SIGTERM when the parent exits, and exit at the latest `exit_within_s`
    after that. False when it has already gone (we were re-parented before the request took effect)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the supervisor's own signal handling still stops its children
    if os.getppid() != parent_pid:
        return False
    # Daemon: it never holds up an exit, and it sleeps in poll() until the parent is gone.
    threading.Thread(target=_exit_after_parent, args=(parent_pid, exit_within_s), name="parent-death",
                     daemon=True).start()
    return True


def _exit_after_parent(parent_pid: int, exit_within_s: float) -> None:
    _wait_for_exit(parent_pid)
    time.sleep(exit_within_s)
    # os.write and os._exit: a stuck thread may hold the logging lock, or be one that the
    # interpreter's exit would join (the non-daemon threads of a ThreadPoolExecutor).
    os.write(2, f"hetero-infer: the supervisor (pid {parent_pid}) is gone and this service did not stop "
                f"within {exit_within_s:g} s; exiting now\n".encode())
    os._exit(1)


def _wait_for_exit(pid: int) -> None:
    """Return once our parent, process `pid`, has exited."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (Python before 3.9, Linux before 5.3): look now and then
        while os.getppid() == pid:
            time.sleep(_POLL_S)
        return
    try:
        if os.getppid() == pid:  # else it died before pidfd_open, and `pid` may name another process now
            poller = select.poll()
            poller.register(fd, select.POLLIN)  # readable once the process has exited
            poller.poll()
    finally:
        os.close(fd)
