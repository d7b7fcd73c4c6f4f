"""Who may call what: a bearer token on the public API; mutual TLS and a shared secret on the internal services.

Public: every call must carry `authorization: Bearer <token>`, the token being SPECDEC_AUTH_TOKEN in the router's
environment or the contents of `auth_token_file`; anything else is UNAUTHENTICATED. A router with no token refuses
to start unless the config says `auth: none` (`public_auth`): auth is on unless someone wrote that it is off.
Tokens are compared as SHA-256 digests with `hmac.compare_digest`: constant time, and the length of the token leaks
nothing either.

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
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import yaml

from deployments.tls import TlsBundle, channel_credentials, channel_options
from specdec_core import environment
from specdec_core.errors import InvalidArgument

ENV_TOKEN = environment.AUTH_TOKEN
INTERNAL_KEY = "specdec-internal-token"

log = logging.getLogger(__name__)


class Unauthenticated(Exception):
    """The call carried no valid credentials; reported as UNAUTHENTICATED."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def load_public_token(token_file: str | None) -> str | None:
    """The public API's token: SPECDEC_AUTH_TOKEN, else the contents of `token_file`, else None (`public_auth`
    decides whether None may serve)."""
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


def load_tenant_tokens(tokens_file: str | None) -> dict[str, str]:
    """Tokens per tenant from `tokens_file` (YAML: tenant name -> token); {} without one."""
    if tokens_file is None:
        return {}
    path = Path(tokens_file)
    if not path.is_file():
        raise InvalidArgument("auth_tokens_file", f"no file at {tokens_file!r}")
    tenants = yaml.safe_load(path.read_text())
    if not isinstance(tenants, dict) or not tenants:
        raise InvalidArgument("auth_tokens_file", "must map each tenant's name to its token")
    for tenant, token in tenants.items():
        if not isinstance(tenant, str) or not tenant or not isinstance(token, str) or not token.strip():
            raise InvalidArgument("auth_tokens_file", f"tenant {tenant!r}: a name and a non-empty token")
    tokens = [token.strip() for token in tenants.values()]
    if len(set(tokens)) < len(tokens):
        raise InvalidArgument("auth_tokens_file", "two tenants share a token: a token names one tenant")
    return {tenant: token.strip() for tenant, token in tenants.items()}


def public_auth(mode: Literal["bearer", "none"], token_file: str | None, tokens_file: str | None = None) -> BearerAuth:
    """The public API's check for the config's `auth` and `auth_token_file`, read when the router starts.

    bearer without a token raises `InvalidArgument`: the router does not start, rather than serve an open API
    because a Secret or a file went missing. none logs a WARNING; a token present all the same is enforced (the
    stricter of the two: whoever set it meant it), and that is logged too."""
    token = load_public_token(token_file)
    tenants = load_tenant_tokens(tokens_file)
    if tenants:
        log.info("auth: %d tenants with tokens of their own, each its own prefix-cache namespace", len(tenants))
        return BearerAuth(token, tenants)
    if token is None and mode == "bearer":
        raise InvalidArgument(
            "auth",
            f"the public API needs a bearer token and there is none: set {ENV_TOKEN} in the router's environment "
            "(on Kubernetes: the Secret specdec-api-token, key `token`) or name a file holding it in "
            "auth_token_file; or say `auth: none` in the config to serve without auth",
        )
    if mode == "none" and token is None:
        log.warning("auth: none: the public API admits every caller without a token (gRPC and HTTP alike)")
    elif mode == "none":
        log.warning("auth: none, but %s is set: every call must carry it all the same", ENV_TOKEN)
    return BearerAuth(token)


class BearerAuth:
    """Checks `authorization: Bearer <token>` metadata against the tokens: one shared token and tokens per tenant
    (none at all: every call is allowed)."""

    def __init__(self, token: str | None, tenants: Mapping[str, str] | None = None) -> None:
        # digest -> tenant (None: the shared token's callers)
        self._tenants: dict[bytes, str | None] = {_digest(t): name for name, t in (tenants or {}).items()}
        if token is not None:
            self._tenants.setdefault(_digest(token), None)

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def check(self, metadata: Sequence[tuple[str, Any]]) -> str | None:
        """The caller's tenant (None: the shared token's, or no auth); `Unauthenticated` without a valid token.
        Every known digest is compared, whichever matches: the time taken says nothing of which."""
        if not self._tenants:
            return None
        values = [v for k, v in metadata if k.lower() == "authorization"]
        scheme, _, token = (values[0] if values else "").partition(" ")
        presented = _digest(token.strip()) if scheme.lower() == "bearer" else b""
        matches = [tenant for digest, tenant in self._tenants.items() if hmac.compare_digest(presented, digest)]
        if not matches:  # b"" never equals a digest
            raise Unauthenticated("missing or invalid bearer token (metadata `authorization: Bearer <token>`)")
        return matches[0]


def cache_namespace(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt a request's cached prefixes are shared under: its own `cache_salt` within its tenant's namespace.
    A tenant's requests without a salt share among themselves only; requests of the shared token (or of no auth)
    keep their salt as it is, and those without one share the common namespace. Fixed length, whatever the two."""
    if tenant is None:
        return cache_salt
    key = f"{len(tenant)}:{tenant}:{cache_salt or ''}".encode("utf-8", "surrogatepass")
    return "tenant-" + hashlib.sha256(key).hexdigest()[:32]


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


class _AddSecret(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Client side: every call on the channel carries the internal secret (the target's Decode streams)."""

    def __init__(self, secret: str) -> None:
        self._pair = (INTERNAL_KEY, secret)

    def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._with_secret(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        return continuation(self._with_secret(details), request)

    def _with_secret(self, details: Any) -> Any:
        return details._replace(metadata=list(details.metadata or ()) + [self._pair])


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
