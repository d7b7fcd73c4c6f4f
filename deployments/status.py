"""One table from the errors the service reports to what a client sees, on every protocol it speaks: the gRPC
status code, the HTTP status and the OpenAI error `type`; and back, from a worker's gRPC status to the error it
stands for in the router.

The router (GenerationService), the workers and an HTTP API all report an error as this module says, so one
failure reads the same whichever way a client asked. An error matches the first row whose type it is an
instance of; an error in no row is a bug or a device failure: INTERNAL, 500, "server_error".
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from deployments.auth import Unauthenticated
from deployments.generation_codec import in_request_terms
from deployments.health import UnknownService
from deployments.scheduler import DeadlineExceeded
from specdec_core.errors import InvalidArgument, ResourceExhausted, Unavailable


class WorkerUnavailable(RuntimeError):
    """A worker could not be reached or failed a call; `code` is the gRPC status to report."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


class WorkerDraining(WorkerUnavailable):
    """A worker being stopped (scaled down) refuses new sessions and finishes those it holds. FAILED_PRECONDITION
    between worker and router, which starts the session on another replica: no client sees it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=grpc.StatusCode.FAILED_PRECONDITION)


class UnknownSession(LookupError):
    """A worker holds no session of that id (never started, or already released)."""


class UnknownModel(LookupError):
    """A request names a model this server does not serve (the HTTP API's `model`)."""


@dataclass(frozen=True)
class Status:
    grpc: grpc.StatusCode
    http: int
    openai_type: str  # the `type` of an OpenAI error object


INTERNAL = Status(grpc.StatusCode.INTERNAL, 500, "server_error")
UNAVAILABLE = Status(grpc.StatusCode.UNAVAILABLE, 503, "server_error")
DRAINING = Status(grpc.StatusCode.FAILED_PRECONDITION, 503, "server_error")  # worker to router only

TABLE: tuple[tuple[type[BaseException], Status], ...] = (
    (InvalidArgument, Status(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")),
    (ResourceExhausted, Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded")),
    (Unauthenticated, Status(grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error")),
    (DeadlineExceeded, Status(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error")),
    (UnknownSession, Status(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error")),
    (UnknownModel, Status(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error")),
    (UnknownService, Status(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error")),
    (Unavailable, UNAVAILABLE),
    (WorkerUnavailable, UNAVAILABLE),  # or INTERNAL: see `status_of`
)

_BY_CODE = {status.grpc: status for _, status in TABLE} | {INTERNAL.grpc: INTERNAL, DRAINING.grpc: DRAINING}


def _row(error: BaseException) -> Status | None:
    return next((status for kind, status in TABLE if isinstance(error, kind)), None)


def status_of(error: BaseException) -> Status:
    """What a client sees for `error`. A worker's failure passed on by the router keeps the code the worker
    reported it with (UNAVAILABLE, or INTERNAL for a worker's own bug)."""
    if isinstance(error, WorkerUnavailable):
        return _BY_CODE.get(error.code, INTERNAL)
    return _row(error) or INTERNAL


def details_of(error: BaseException) -> str:
    """The message a client reads: a bad argument named as the request's field ("sampling.max_tokens: ..."); an
    error in no row also names its type, its text having never been meant for clients."""
    if isinstance(error, InvalidArgument):
        return str(in_request_terms(error))
    if _row(error) is None:
        return f"{type(error).__name__}: {error}"
    return str(error)


def grpc_status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and details for `error`."""
    return status_of(error).grpc, details_of(error)


def http_status_of(error: BaseException) -> int:
    """The HTTP status for `error` (the OpenAI error `type` is `status_of(error).openai_type`)."""
    return status_of(error).http


# -- back: a worker's status, as the router sees it -------------------------------------------------------------

# A worker reports these with details "field: message": the router raises them again as the same error.
_FIELD_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}
# The worker could not be reached or did not answer in time: what it held for the call is gone or in doubt.
_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def error_of(code: grpc.StatusCode, details: str | None, what: str) -> Exception:
    """The error a worker's status `code` stands for; `what` says which call failed (for the message)."""
    kind = _FIELD_ERRORS.get(code)
    if kind is not None:
        field, _, message = (details or "").partition(": ")
        return kind(field or "request", message or details)
    if code in _LOST:
        return WorkerUnavailable(f"{what}: {code.name}: {details}")
    if code == DRAINING.grpc:
        return WorkerDraining(f"{what}: {details}")
    return WorkerUnavailable(f"{what}: {code.name}: {details}", code=grpc.StatusCode.INTERNAL)
