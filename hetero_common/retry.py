"""Retries of internal gRPC calls: which failures are worth another try, and how to wait.

Only UNAVAILABLE is transient (the peer restarting, a connection reset): any other status
is an answer, and repeating the call would only repeat it.
"""

from __future__ import annotations

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from hetero_common.config import Config

MAX_BACKOFF_S = 1.0


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


def link_silent(exc: grpc.aio.AioRpcError) -> bool:
    """The call failed because the peer stopped answering keepalive pings, not because it closed
    or refused the connection (gRPC core says "ping timeout"; older cores "keepalive watchdog").
    With data in flight the kernel may say it first: gRPC sets TCP_USER_TIMEOUT to the keepalive
    timeout, and unacknowledged data then ends the call with "recvmsg:Connection timed out (110)"
    (seen mid-stream in tests/multihost/test_multihost.py about one cut in three: taken for a lost step, the
    replica was retried and went down only after 3.0 s)."""
    details = (exc.details() or "").lower()
    return "ping timeout" in details or "keepalive" in details or "connection timed out" in details


def retrying(config: Config) -> AsyncRetrying:
    """At most `max_retry_attempts` retries of a transient failure, with exponential backoff and
    jitter from `retry_backoff_s` (capped at 1 s); the last failure is re-raised as it is."""
    return AsyncRetrying(stop=stop_after_attempt(config.max_retry_attempts + 1), reraise=True,
                         wait=wait_exponential_jitter(initial=config.retry_backoff_s, max=MAX_BACKOFF_S),
                         retry=retry_if_exception(is_transient))
