"""Errors -> statuses, one table for every protocol; and a worker's status back to the router's error."""

from __future__ import annotations

import grpc
import pytest

from deployments import status
from deployments.auth import Unauthenticated
from deployments.health import UnknownService
from deployments.replica_pool import WorkerUnavailable as RemoteWorkerUnavailable
from deployments.scheduler import DeadlineExceeded
from deployments.status import UnknownModel, UnknownSession, WorkerUnavailable
from deployments.workers import UnknownSession as WorkersUnknownSession
from specdec_core.errors import InvalidArgument, ModelNotFound, ResourceExhausted, Unavailable

Code = grpc.StatusCode


@pytest.mark.parametrize(
    "error, code, http, openai_type, details",
    [
        (InvalidArgument("prompt", "empty"), Code.INVALID_ARGUMENT, 400, "invalid_request_error", "prompt: empty"),
        # the engine's field, named as the request's
        (
            InvalidArgument("max_tokens", "too many"),
            Code.INVALID_ARGUMENT,
            400,
            "invalid_request_error",
            "sampling.max_tokens: too many",
        ),
        (ResourceExhausted("kv_cache", "full"), Code.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded", "kv_cache: full"),
        (Unauthenticated("no token"), Code.UNAUTHENTICATED, 401, "authentication_error", "no token"),
        (DeadlineExceeded("late"), Code.DEADLINE_EXCEEDED, 504, "server_error", "late"),
        (UnknownSession("seq_id: none"), Code.NOT_FOUND, 404, "invalid_request_error", "seq_id: none"),
        (UnknownModel("no such model"), Code.NOT_FOUND, 404, "invalid_request_error", "no such model"),
        (UnknownService("no service 'x'"), Code.NOT_FOUND, 404, "invalid_request_error", "no service 'x'"),
        (Unavailable("target", "rank died"), Code.UNAVAILABLE, 503, "server_error", "target: rank died"),
        (WorkerUnavailable("gone"), Code.UNAVAILABLE, 503, "server_error", "gone"),
        (WorkerUnavailable("bug there", code=Code.INTERNAL), Code.INTERNAL, 500, "server_error", "bug there"),
        # in no row: a bug, reported with its type
        (KeyError("x"), Code.INTERNAL, 500, "server_error", "KeyError: 'x'"),
        (ModelNotFound("m"), Code.INTERNAL, 500, "server_error", "ModelNotFound: m"),
    ],
)
def test_each_error_has_one_status_on_every_protocol(error, code, http, openai_type, details):
    assert status.grpc_status_of(error) == (code, details)
    assert status.http_status_of(error) == http
    assert status.status_of(error).openai_type == openai_type


def test_every_row_of_the_table_is_tested():
    tested = {
        InvalidArgument,
        ResourceExhausted,
        Unauthenticated,
        DeadlineExceeded,
        UnknownSession,
        UnknownModel,
        UnknownService,
        Unavailable,
        WorkerUnavailable,
    }
    assert {kind for kind, _ in status.TABLE} == tested


def test_the_former_homes_of_the_errors_name_the_same_classes():
    assert RemoteWorkerUnavailable is WorkerUnavailable and WorkersUnknownSession is UnknownSession


@pytest.mark.parametrize(
    "code, details, kind, field, worker_code",
    [
        (Code.INVALID_ARGUMENT, "q: 3 distributions for 2 drafts", InvalidArgument, "q", None),
        (Code.INVALID_ARGUMENT, "no field here", InvalidArgument, "no field here", None),
        (Code.RESOURCE_EXHAUSTED, "sessions: 4 new, 1 free", ResourceExhausted, "sessions", None),
        (Code.UNAVAILABLE, "connection refused", WorkerUnavailable, None, Code.UNAVAILABLE),
        (Code.DEADLINE_EXCEEDED, "", WorkerUnavailable, None, Code.UNAVAILABLE),
        (Code.INTERNAL, "Verify failed: KeyError", WorkerUnavailable, None, Code.INTERNAL),
        (Code.NOT_FOUND, "seq_id: gone", WorkerUnavailable, None, Code.INTERNAL),
    ],
)
def test_a_workers_status_comes_back_as_the_routers_error(code, details, kind, field, worker_code):
    error = status.error_of(code, details, "target worker w: Verify")
    assert type(error) is kind
    if field is not None:
        assert error.field == field
    else:
        assert error.code == worker_code and str(error).startswith(f"target worker w: Verify: {code.name}")


def test_a_field_error_keeps_its_status_there_and_back():
    sent = InvalidArgument("uniform", "3 uniforms for 2 sampled drafts")
    back = status.error_of(*status.grpc_status_of(sent), "draft worker w: Propose")
    assert status.grpc_status_of(back) == status.grpc_status_of(sent)
