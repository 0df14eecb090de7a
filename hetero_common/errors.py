"""Typed errors, each mapped once to a gRPC status code and an HTTP status.

Every message says what to fix. Services raise these; the edges (gRPC servicers, the HTTP
app, the CLI) translate them with `grpc_status_for` / `http_status_for` and nowhere else.
"""

from __future__ import annotations

import grpc


class HeteroError(Exception):
    """Base class. `grpc_code`/`http_status` say how the edges report it."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(HeteroError):
    """A configuration value is invalid; the message names the key."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 500


class ValidationError(HeteroError):
    """A request field is invalid; the message names the field and the allowed range.
    `param` names the field too, for HTTP's OpenAI error shape (`error.param`)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(ValidationError):
    """An unknown model or LoRA adapter name: NOT_FOUND over gRPC, 404 over HTTP (as OpenAI answers)."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class AuthenticationError(HeteroError):
    """No API key, or one the gateway does not accept."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class PermissionDeniedError(HeteroError):
    """A valid key without the role a call needs (an admin key: docs/security.md)."""

    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403


class OverloadedError(HeteroError):
    """Queues are full; retry later."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class RequestTooLargeError(HeteroError):
    """A request body or message over `serving.max_request_bytes`: refused before it is read on."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


class RequestTimeoutError(HeteroError):
    """A request's body did not arrive within `serving.http_body_timeout_s` (a slow or stalled client)."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 408


class UnavailableError(HeteroError):
    """A downstream service (scheduler, worker) cannot be reached."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class ExecutionError(HeteroError):
    """The model failed while running a step."""

    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500


class StepOrderError(ExecutionError):
    """Internal (worker to scheduler): a step planned ahead, assuming the step before it
    (StepPlan.after_step_id), which failed or never arrived; the scheduler has already handled that one."""

    grpc_code = grpc.StatusCode.ABORTED


class DuplicateRequestError(HeteroError):
    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class LoraAdapterExistsError(HeteroError):
    """A LoRA adapter of that name is loaded already (load it with `replace` to swap it)."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class LoraSlotsFullError(HeteroError):
    """Every one of the workers' `max_loras` slots holds an adapter (or one still finishing its requests)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409


# --- deadlines, and the command bridge program failing ---

class DeadlineExceededError(HeteroError):
    """The request's deadline (the caller's gRPC timeout, or the bridge's timeout) passed first."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class RequestAbortedError(HeteroError):
    """A request answered once (Embed) was aborted before it finished: by `Abort`, or by an operator."""

    grpc_code = grpc.StatusCode.ABORTED
    http_status = 409


class UnsupportedError(HeteroError):
    """The configured backend cannot serve this kind of request (the command bridge and embeddings)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 400


class CommandBridgeError(ExecutionError):
    """The command bridge program failed (non-zero exit, or it could not start); the message says so, and
    its stderr tail goes to the gateway's log, never to the client."""


class CommandBridgeNotFoundError(HeteroError):
    """The configured bridge program does not exist or is not executable: a deployment problem."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 500


def grpc_status_for(error: BaseException) -> grpc.StatusCode:
    return error.grpc_code if isinstance(error, HeteroError) else grpc.StatusCode.INTERNAL


def http_status_for(error: BaseException) -> int:
    return error.http_status if isinstance(error, HeteroError) else 500


_FROM_GRPC: dict[grpc.StatusCode, type[HeteroError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: ValidationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.ALREADY_EXISTS: DuplicateRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: ConfigError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.NOT_FOUND: ModelNotFoundError,
}


def from_grpc_error(error: grpc.RpcError, service: str,
                    classes: dict[grpc.StatusCode, type[HeteroError]] | None = None) -> HeteroError:
    """Turn a downstream RpcError back into the typed error it stands for (`classes`: a call's own mapping,
    where a status code means something more precise for it)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = (classes or {}).get(code) or _FROM_GRPC.get(code, ExecutionError)
    if cls is UnavailableError:
        return UnavailableError(f"{service} is unavailable ({details}); check that it is running and its address is right")
    return cls(details or f"{service} failed with {code.name}")
