"""The standard gRPC health service, `grpc.health.v1.Health`, on the public gRPC port: its Check answered by the
router.

Serve's gRPC proxy hands every method of the services in `grpc_servicer_functions` to the ingress deployment of an
application and calls the replica's method of the same name: Check reaches `Router.Check`. SERVING therefore says
that the proxy, the application and a router replica are up, and that the router has a target worker to run on.
The proxy picks the application by the `application` metadata, or takes the only one there is: Kubernetes' gRPC
probes send no metadata, so they are routed only while Serve runs one application.

Only Check is registered. Watch is a stream that the router would hold open, one of its `max_ongoing_requests`, for
as long as the client watches; left out, it is UNIMPLEMENTED from the proxy itself (gRPC's client-side health
checking then counts the server as healthy). List likewise.

This module is imported by Serve's proxy (through `grpc_servicer_functions`): keep it to grpc and protobuf, no engine.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from specdec.v1 import generation_pb2

SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# What Check answers for: "" (the server as a whole, as probes without a `service` ask) and the public service.
CHECKED = ("", generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name)


class UnknownService(LookupError):
    """A Check for a service this server does not serve: NOT_FOUND, as the health protocol says."""


def add_health_to_server(servicer: Any, server: grpc.Server) -> None:
    """Register `servicer.Check` as grpc.health.v1.Health/Check on `server`, as a generated `add_*_to_server` would.

    `grpc_servicer_functions` names it: Serve's proxy calls it with a stand-in servicer and routes the method to
    the router."""
    handlers = {
        "Check": grpc.unary_unary_rpc_method_handler(
            servicer.Check,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def check(service: str, serving: bool) -> health_pb2.HealthCheckResponse:
    """Check's answer for `service` from a router that can (`serving`) or cannot start a request now."""
    if service not in CHECKED:
        raise UnknownService(f"no service {service!r} here; Check answers for {list(CHECKED)}")
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    return health_pb2.HealthCheckResponse(status=status)
