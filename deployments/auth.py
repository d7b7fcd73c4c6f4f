"""Who may call what: a bearer token on the public API, and a shared secret on the internal worker services.

Public: when SPECDEC_AUTH_TOKEN is set in the router's environment (or `auth_token_file` names a file), every
call must carry `authorization: Bearer <token>`; anything else is UNAUTHENTICATED. Tokens are compared as
SHA-256 digests with `hmac.compare_digest`: constant time, and the length of the token leaks nothing either.

Internal: the draft and target workers serve only callers that present the application's internal secret in
`specdec-internal-token` metadata. The secret is made at random by the registry actor, once per application,
and handed to the router and the workers through Ray; a process that can read it is one that can already run
code in the Ray cluster, so it admits nothing that the cluster does not already trust. GetStats stays open:
it returns counters only, and probes and the soak tool read it.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc

from specdec_core import environment
from specdec_core.errors import InvalidArgument

ENV_TOKEN = environment.AUTH_TOKEN
INTERNAL_KEY = "specdec-internal-token"
OPEN_METHODS = frozenset({"GetStats"})  # internal methods that need no secret


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


class InternalAuthInterceptor(grpc.ServerInterceptor):
    """Server side of the internal secret: refuses every method but OPEN_METHODS without it."""

    def __init__(self, secret: str) -> None:
        self._digest = _digest(secret)

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "internal service: missing or invalid specdec-internal-token")

        self._refusal = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if method in OPEN_METHODS:
            return continuation(handler_call_details)
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


def internal_channel(channel: grpc.Channel, secret: str | None) -> grpc.Channel:
    """`channel` with the internal secret added to every call (unchanged when there is no secret)."""
    return channel if secret is None else grpc.intercept_channel(channel, _AddSecret(secret))
