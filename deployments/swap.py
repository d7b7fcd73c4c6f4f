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

from deployments.serve_config import DEFAULT_VARIANT, ServeConfig, parse_config
from specdec_core.errors import InvalidArgument

# What the init args say in place of a draft model: the config still validates, and a path used by mistake names
# where the real one is.
SWAPPED_OUT = "<draft.model: in the deployment's user_config>"
ARGS_WEIGHT = 1.0  # what the init args say in place of a variant's weight (the router's user_config has it)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DraftSwap(_Strict):
    """The user_config of a draft worker deployment: which checkpoint it serves (a path, a .gguf file or a
    `specdec models` name). A change of it is a hot swap."""

    model: str = Field(min_length=1)


class VariantSwap(_Strict):
    model: str | None = Field(None, min_length=1)  # a variant that runs a draft model: its checkpoint
    weight: float | None = Field(None, ge=0)  # `drafts:` only: its share of new requests


class RouterSwap(_Strict):
    """The user_config of the router deployment: each draft variant's model and weight ("default": a single
    `draft`). A change of it relabels new requests, and (re)sets the weights: promotion of a demoted variant."""

    variants: dict[str, VariantSwap]


@dataclass(frozen=True)
class Split:
    args: dict[str, Any]  # every deployment's init args (a `ServeConfig` as JSON), the swappable parts neutralised
    workers: dict[str, dict[str, Any]]  # a draft worker deployment's name -> its user_config (a `DraftSwap`)
    router: dict[str, Any] | None  # the router's user_config (a `RouterSwap`); None where nothing swaps


def split(cfg: ServeConfig) -> Split:
    """`cfg` as init args and the swappable user_configs."""
    args = cfg.model_dump(mode="json")
    if cfg.drafts is None:
        if not (cfg.draft.runs_draft_model and cfg.draft.model):
            return Split(args, {}, None)
        args["draft"]["model"] = SWAPPED_OUT
        model = {"model": cfg.draft.model}
        return Split(args, {"DraftWorker": model}, {"variants": {DEFAULT_VARIANT: model}})
    workers, variants = {}, {}
    for variant, neutral in zip(cfg.drafts, args["drafts"]):
        variants[variant.name] = {"weight": variant.weight}
        neutral["weight"] = ARGS_WEIGHT
        if variant.runs_draft_model and variant.model:
            variants[variant.name]["model"] = variant.model
            neutral["model"] = SWAPPED_OUT
            workers[f"DraftWorker-{variant.name}"] = {"model": variant.model}
    control = next(n for v, n in zip(cfg.drafts, args["drafts"]) if v.name == cfg.control_variant.name)
    args["draft"] = {key: value for key, value in control.items() if key not in ("name", "weight")}
    return Split(args, workers, {"variants": variants})


def _validated(kind: type[BaseModel], user_config: Any) -> Any:
    try:
        return kind.model_validate(user_config)
    except ValidationError as exc:
        problems = [
            f"user_config.{'.'.join(str(p) for p in e['loc']) or 'model'}: "
            f"{'unknown key' if e['type'] == 'extra_forbidden' else e['msg']}"
            for e in exc.errors()
        ]
        raise InvalidArgument("user_config", "; ".join(problems)) from None


def draft_swap(user_config: Any) -> DraftSwap:
    """A draft worker's user_config validated; `InvalidArgument` names a bad or unknown key."""
    return _validated(DraftSwap, user_config)


def apply(cfg: ServeConfig, user_config: Any) -> ServeConfig:
    """`cfg` (parsed from init args) with the models and weights the router's `user_config` holds."""
    swap = _validated(RouterSwap, user_config)
    names = [v.name for v in cfg.variants]
    unknown = sorted(set(swap.variants) - set(names))
    if unknown:
        raise InvalidArgument(
            "user_config.variants", f"no draft variant {', '.join(unknown)}; the config has {', '.join(names)}"
        )
    data = cfg.model_dump(mode="json")
    if cfg.drafts is None:
        entry = swap.variants.get(DEFAULT_VARIANT)
        if entry is not None and entry.model is not None:
            data["draft"]["model"] = entry.model
        return parse_config(data)
    for variant in data["drafts"]:
        entry = swap.variants.get(variant["name"])
        if entry is not None:
            variant.update({k: v for k, v in (("model", entry.model), ("weight", entry.weight)) if v is not None})
    data.pop("draft")  # the control's, filled in again from drafts
    return parse_config(data)


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
