"""Hot swap: the part of the config that changes without restarting a replica (the draft's model).

Ray Serve (2.60) restarts a deployment's replicas when its version changes, and only calls `reconfigure(user_config)`
on the running ones when nothing but lightweight options (the user_config among them) changed. It never compares
init args: a deployment's version is what decides. `serve.run` gives each deployment a random version unless one is
set, so every redeploy restarts every replica; `serve deploy` gives all of an application's deployments a hash of
its import path and `args`, so a change of `args` restarts them all, and a per-deployment `user_config` override
(the Serve config's `deployments:` list) with `args` unchanged reconfigures in place.

So `split` moves the swappable part into the user_config of the deployments that use it and neutralises it in the
init args that every deployment gets, and `version` names what does need a restart (the deployment, its init
args, the code): `build_app` sets it, so that `serve.run` of a config that changes only the draft model keeps every
replica and reconfigures the draft workers and routers.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.config import ServeConfig, parse_config
from specdec_core.errors import InvalidArgument

# What the init args say in place of the draft model: the config still validates, and a path used by mistake names
# where the real one is.
SWAPPED_OUT = "<draft.model: in the deployment's user_config>"


class DraftSwap(BaseModel):
    """The user_config of a deployment that serves or labels a draft model: which checkpoint (a path, a .gguf
    file or a `specdec models` name). A change of it is a hot swap."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = Field(min_length=1)


@dataclass(frozen=True)
class Split:
    args: dict[str, Any]  # every deployment's init args (a `ServeConfig` as JSON), the swappable part neutralised
    user_config: dict[str, Any] | None  # a `DraftSwap` as JSON; None where nothing swaps (no draft model)


def split(cfg: ServeConfig) -> Split:
    """`cfg` as init args and the swappable user_config."""
    args = cfg.model_dump(mode="json")
    if not (cfg.draft.runs_draft_model and cfg.draft.model):
        return Split(args, None)
    args["draft"]["model"] = SWAPPED_OUT
    return Split(args, DraftSwap(model=cfg.draft.model).model_dump())


def draft_swap(user_config: Any) -> DraftSwap:
    """Validate a user_config; `InvalidArgument` names a bad or unknown key."""
    try:
        return DraftSwap.model_validate(user_config)
    except ValidationError as exc:
        problems = [f"user_config.{'.'.join(str(p) for p in e['loc']) or 'model'}: "
                    f"{'unknown key' if e['type'] == 'extra_forbidden' else e['msg']}" for e in exc.errors()]
        raise InvalidArgument("user_config", "; ".join(problems)) from None


def apply(cfg: ServeConfig, user_config: Any) -> ServeConfig:
    """`cfg` (parsed from init args) with the swappable part that `user_config` holds."""
    return parse_config({**cfg.model_dump(mode="json"),
                         "draft": {**cfg.draft.model_dump(mode="json"), "model": draft_swap(user_config).model}})


def version(name: str, args: dict[str, Any]) -> str:
    """The version of deployment `name` with init args `args`: equal exactly when a replica need not restart.
    The code is part of it: a redeploy from changed sources restarts, as Serve's own random versions would."""
    text = json.dumps({"name": name, "args": args}, sort_keys=True)
    return hashlib.sha256((text + _code_fingerprint()).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """A hash of the sources the replicas run: this package, the engine and the wire contract's stubs."""
    import specdec.v1.worker_pb2
    import specdec_core

    roots = [Path(__file__).parent, Path(specdec_core.__file__).parent, Path(specdec.v1.worker_pb2.__file__).parent]
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
