"""Where the workers' gRPC servers are, and what it takes to call them: a small named Ray actor.

Routers talk to workers over gRPC, not through Serve handles, so they need addresses. Each worker replica
registers (app, kind, replica id) -> "ip:port" when it starts and unregisters when it stops; routers read the
addresses and refresh them. Routers also report the sessions that wait for a worker's slot, which the worker
replicas read back for Serve's autoscaling (`deployments.autoscaling`). It also hands out each application's
internal credentials (`credentials`): the secret (`deployments.auth`), and the certificates of mutual TLS, which it
issues from the application's CA (`deployments.tls`), made on first ask; the CA's key never leaves the actor.
Detached, so it outlives whichever replica created it; `shutdown` removes it. It lives on the head node, whichever
process asks first: on a node that may be lost it would take the addresses and the CA with it, and the next ask
would make another CA, whose certificates the running routers and workers refuse.
"""

from __future__ import annotations

import logging
import secrets
import time

import ray

from deployments import tls
from deployments.auth import InternalCredentials

log = logging.getLogger(__name__)

NAME = "specdec-registry"
NAMESPACE = "specdec"
# The resource only the head node has (Serve pins its controller with it too); a sliver of it pins an actor there.
HEAD_NODE_RESOURCE = "node:__internal_head__"
WAITING_TTL_S = 5.0  # a router's report of waiting sessions counts this long (it reports every second or so)


def draft_kind(variant: str | None) -> str:
    """The registry's name for the draft workers of `variant` (None: the single `draft`)."""
    return "draft" if variant is None else f"draft-{variant}"


@ray.remote(num_cpus=0, resources={HEAD_NODE_RESOURCE: 0.001})
class _Registry:
    def __init__(self) -> None:
        self._addresses: dict[tuple[str, str], dict[str, str]] = {}
        self._secrets: dict[str, str] = {}
        self._settings: dict[str, tls.TlsSetting] = {}
        self._authorities: dict[str, tls.Authority] = {}
        self._waiting: dict[str, dict[str, tuple[float, dict[str, int]]]] = {}  # app -> router -> (when, by kind)

    def register(self, app: str, kind: str, replica_id: str, address: str) -> None:
        self._addresses.setdefault((app, kind), {})[replica_id] = address

    def unregister(self, app: str, kind: str, replica_id: str) -> None:
        self._addresses.get((app, kind), {}).pop(replica_id, None)

    def addresses(self, app: str, kind: str) -> list[str]:
        return sorted(self._addresses.get((app, kind), {}).values())

    def report_waiting(self, app: str, router: str, waiting: dict[str, int]) -> None:
        """`router`'s sessions that wait for a slot, by worker kind (the latest report replaces the last)."""
        self._waiting.setdefault(app, {})[router] = (time.monotonic(), dict(waiting))

    def waiting(self, app: str, kind: str) -> int:
        """Sessions waiting for a `kind` worker's slot, over the routers that reported lately."""
        reports = self._waiting.get(app, {})
        now = time.monotonic()
        for router in [r for r, (at, _) in reports.items() if now - at > WAITING_TTL_S]:
            del reports[router]  # a router gone (or stalled) no longer counts
        return sum(counts.get(kind, 0) for _, counts in reports.values())

    def secret(self, app: str) -> str:
        """The application's internal secret (`deployments.auth`), made on first ask."""
        return self._secrets.setdefault(app, secrets.token_urlsafe(32))

    def credentials(
        self, app: str, role: tls.Role, setting: tls.TlsSetting | None
    ) -> tuple[str, tls.TlsSetting, tls.TlsBundle | None]:
        """The application's secret, its TLS setting, and, when TLS is on without a mounted directory, a fresh
        certificate for `role` signed by the application's CA. `setting`: from the application's config (its
        workers and routers give it); None: as they gave it (tools, which know only the application's name)."""
        if setting is not None:
            self._settings[app] = setting
        known = self._settings.get(app)
        if known is None:
            raise LookupError(f"application {app!r}: no worker or router has started, its internal_tls is unknown")
        issued = None
        if known.enabled and known.directory is None:
            if app not in self._authorities:
                self._authorities[app] = tls.make_authority(app)
            issued = tls.issue(self._authorities[app], role, app)
        return self.secret(app), known, issued


def registry() -> ray.actor.ActorHandle:
    return _Registry.options(name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote()


def credentials(app: str, role: tls.Role, setting: tls.TlsSetting | None = None) -> InternalCredentials:
    """What this process presents on `app`'s internal services as `role`, from the registry actor (`setting`:
    as there). A mounted certificate directory is read here, in this process: its key never travels through Ray,
    so it must be mounted where every worker, router and tool of the application runs."""
    secret, known, issued = ray.get(registry().credentials.remote(app, role, setting))
    if not known.enabled:
        log.warning(
            "application %s: internal_tls is false, so traffic between its router and workers (the "
            "internal secret, every session's tokens) crosses the network in plaintext",
            app,
        )
        return InternalCredentials(secret)
    return InternalCredentials(secret, issued if known.directory is None else tls.load_dir(known.directory))


def shutdown() -> None:
    try:
        ray.kill(ray.get_actor(NAME, namespace=NAMESPACE))
    except ValueError:
        pass  # never created
