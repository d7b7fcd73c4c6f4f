"""Where the workers' gRPC servers are: a small named Ray actor that worker replicas register with.

Routers talk to workers over gRPC, not through Serve handles, so they need addresses. Each worker replica
registers (app, kind, replica id) -> "ip:port" when it starts and unregisters when it stops; routers read the
addresses and refresh them. It also hands out each application's internal secret (`deployments.auth`). Detached, so it outlives whichever replica created it; `shutdown` removes it.
"""

from __future__ import annotations

import secrets

import ray

NAME = "specdec-registry"
NAMESPACE = "specdec"


@ray.remote(num_cpus=0)
class _Registry:
    def __init__(self) -> None:
        self._addresses: dict[tuple[str, str], dict[str, str]] = {}
        self._secrets: dict[str, str] = {}

    def register(self, app: str, kind: str, replica_id: str, address: str) -> None:
        self._addresses.setdefault((app, kind), {})[replica_id] = address

    def unregister(self, app: str, kind: str, replica_id: str) -> None:
        self._addresses.get((app, kind), {}).pop(replica_id, None)

    def addresses(self, app: str, kind: str) -> list[str]:
        return sorted(self._addresses.get((app, kind), {}).values())

    def secret(self, app: str) -> str:
        """The application's internal secret (`deployments.auth`), made on first ask."""
        return self._secrets.setdefault(app, secrets.token_urlsafe(32))


def registry() -> "ray.actor.ActorHandle":
    return _Registry.options(name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote()


def shutdown() -> None:
    try:
        ray.kill(ray.get_actor(NAME, namespace=NAMESPACE))
    except ValueError:
        pass  # never created
