"""The standard gRPC health service: Check alone registered, what it answers; and on the public port of the session's
served stack (real Ray Serve, real gRPC), with no metadata, as Kubernetes' gRPC probes call it."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deployments import health

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PUBLIC = "specdec.v1.GenerationService"


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("service", ["", PUBLIC])
@pytest.mark.parametrize("serving, status", [(True, SERVING), (False, NOT_SERVING)])
def test_check_answers_for_the_server_and_the_public_service(service, serving, status):
    assert health.check(service, serving).status == status


@pytest.mark.parametrize("service", ["grpc.health.v1.Health", "specdec.v1.TargetService", "nope"])
def test_check_of_another_service_is_unknown(service):
    with pytest.raises(health.UnknownService, match=repr(service)):
        health.check(service, serving=True)


class _Servicer:
    def __init__(self) -> None:
        self.asked: list[str] = []

    def Check(self, request, context):
        self.asked.append(request.service)
        return health.check(request.service, serving=False)


@pytest.fixture()
def plain_server():
    """add_health_to_server on a plain gRPC server (what Serve's proxy does with it, minus the routing)."""
    servicer = _Servicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health.add_health_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield health_pb2_grpc.HealthStub(channel), servicer
    server.stop(None)


def test_only_check_is_registered_so_watch_and_list_are_unimplemented(plain_server):
    stub, servicer = plain_server
    assert stub.Check(health_pb2.HealthCheckRequest(service=PUBLIC), timeout=10).status == NOT_SERVING
    assert servicer.asked == [PUBLIC]
    request = health_pb2.HealthCheckRequest()
    assert code_of(lambda: next(stub.Watch(request, timeout=10))) == grpc.StatusCode.UNIMPLEMENTED
    assert code_of(lambda: stub.List(health_pb2.HealthListRequest(), timeout=10)) == grpc.StatusCode.UNIMPLEMENTED
    assert servicer.asked == [PUBLIC]


# --- through Serve's gRPC proxy -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def public_health(served):
    address, _ = served
    with grpc.insecure_channel(address) as channel:
        yield health_pb2_grpc.HealthStub(channel)


@pytest.mark.parametrize("service", ["", PUBLIC])
def test_a_probe_without_metadata_gets_serving_on_the_public_port(public_health, service):
    response = public_health.Check(health_pb2.HealthCheckRequest(service=service), timeout=60)
    assert response.status == SERVING


def test_an_unknown_service_is_not_found_and_watch_unimplemented_on_the_public_port(public_health):
    unknown = health_pb2.HealthCheckRequest(service="specdec.v1.NoSuchService")
    with pytest.raises(grpc.RpcError) as err:
        public_health.Check(unknown, timeout=60)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "NoSuchService" in err.value.details()
    watch = health_pb2.HealthCheckRequest(service=PUBLIC)
    assert code_of(lambda: next(public_health.Watch(watch, timeout=60))) == grpc.StatusCode.UNIMPLEMENTED
