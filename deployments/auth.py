"""Who may call what: a bearer token on the public API; mutual TLS and a shared secret on the internal services.

Public: when SPECDEC_AUTH_TOKEN is set in the router's environment (or `auth_token_file` names a file), every
call must carry `authorization: Bearer <token>`; anything else is UNAUTHENTICATED. Tokens are compared as
SHA-256 digests with `hmac.compare_digest`: constant time, and the length of the token leaks nothing either.

Internal: the draft and target workers serve only over mutual TLS (`deployments.tls`: a handshake needs a client
certificate from the application's CA, and the router checks the worker's), and only callers that also present
the application's internal secret in `specdec-internal-token` metadata, every method alike (GetStats included).
Both are made by the registry actor, once per application, and handed to routers, workers and tools through Ray
(`deployments.worker_registry.credentials`): a process that can get them is one that can already run code in the Ray
cluster, so they admit nothing that the cluster does not already trust. TLS keeps them, and every session's
tokens, off the wire; the secret stays as a second check behind it (defence in depth: it still holds where TLS is
switched off, `internal_tls: false`, or a mounted certificate is shared more widely than the application).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from deployments.tls import TlsBundle, channel_credentials, channel_options
from specdec_core import environment
from specdec_core.errors import InvalidArgument

ENV_TOKEN = environment.AUTH_TOKEN
INTERNAL_KEY = "specdec-internal-token"


class Unauthenticated(Exception):
    """The call carried no valid credentials; reported as UNAUTHENTICATED."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def load_public_token(token_file: str | None) -> str | None:
    """The public API's token: SPECDEC_AUTH_TOKEN, else the contents of `token_file`, else None (no auth)."""
    token = environment.auth_token()
    if token:
        return token
    if token_file is None:
        return None
    path = Path(token_file)
    if not path.is_file():
        raise InvalidArgument("auth_token_file", f"no file at {token_file!r}")
    token = path.read_text().strip()
    if not token:
        raise InvalidArgument("auth_token_file", f"{token_file!r} is empty")
    return token


class BearerAuth:
    """Checks `authorization: Bearer <token>` metadata against one token (None: every call is allowed)."""

    def __init__(self, token: str | None) -> None:
        self._digest = None if token is None else _digest(token)

    @property
    def enabled(self) -> bool:
        return self._digest is not None

    def check(self, metadata: Sequence[tuple[str, Any]]) -> None:
        if self._digest is None:
            return
        values = [v for k, v in metadata if k.lower() == "authorization"]
        scheme, _, token = (values[0] if values else "").partition(" ")
        presented = _digest(token.strip()) if scheme.lower() == "bearer" else b""
        if not hmac.compare_digest(presented, self._digest):  # b"" never equals a digest
            raise Unauthenticated("missing or invalid bearer token (metadata `authorization: Bearer <token>`)")


@dataclass(frozen=True)
class InternalCredentials:
    """What one process of an application holds for the internal services: the secret, and its TLS material
    (a worker's server certificate or a client's; None: plaintext, `internal_tls: false`)."""

    secret: str = field(repr=False)
    tls: TlsBundle | None = None


class InternalAuthInterceptor(grpc.ServerInterceptor):
    """Server side of the internal secret: refuses every method without it."""

    def __init__(self, secret: str) -> None:
        self._digest = _digest(secret)

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "internal service: missing or invalid specdec-internal-token"
            )

        self._refusal = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        presented = next((v for k, v in handler_call_details.invocation_metadata or () if k == INTERNAL_KEY), "")
        if hmac.compare_digest(_digest(presented), self._digest):
            return continuation(handler_call_details)
        return self._refusal


class _AddSecret(grpc.UnaryUnaryClientInterceptor):
    """Client side: every call on the channel carries the internal secret."""

    def __init__(self, secret: str) -> None:
        self._pair = (INTERNAL_KEY, secret)

    def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        metadata = list(details.metadata or ()) + [self._pair]
        return continuation(details._replace(metadata=metadata), request)


def dial(
    address: str, credentials: InternalCredentials | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to the worker at `address` presenting `credentials`: mutual TLS with its certificate (when it has
    TLS material), every call carrying the secret. None: plaintext and no secret, for a worker served without
    credentials (tests of the services alone)."""
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    if credentials.tls is None:
        channel = grpc.insecure_channel(address, options=list(options))
    else:
        bundle = credentials.tls
        channel = grpc.secure_channel(
            address, channel_credentials(bundle), options=[*options, *channel_options(bundle)]
        )
    return grpc.intercept_channel(channel, _AddSecret(credentials.secret))
