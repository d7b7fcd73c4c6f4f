"""Rendering the kustomize overlays and reading what they render: pod templates, env, mounts."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
from pathlib import Path, PurePosixPath

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())


@functools.cache
def _render_dir(path: str) -> tuple[dict, ...]:
    out = subprocess.run(["kubectl", "kustomize", path], capture_output=True, text=True, check=True, timeout=60).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def render(overlay: str) -> list[dict]:
    """The documents `kubectl kustomize k8s/overlays/OVERLAY` prints (a fresh copy: tests may change them)."""
    return copy.deepcopy(list(_render_dir(str(K8S / "overlays" / overlay))))


def render_with(tmp_path: Path, overlay: str, component: str) -> list[dict]:
    """An overlay with one more component, as a user would write it: a kustomization beside the repo's."""

    def rel(p: Path) -> str:  # kustomize takes no absolute paths
        return os.path.relpath(p, tmp_path)

    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {"resources": [rel(K8S / "overlays" / overlay)], "components": [rel(K8S / "components" / component)]}
        )
    )
    return copy.deepcopy(list(_render_dir(str(tmp_path))))


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return doc


def of_group(docs: list[dict], group: str) -> list[dict]:
    return [d for d in docs if d["apiVersion"].split("/")[0] == group and "/" in d["apiVersion"]]


def pod_templates(service: dict) -> dict[str, dict]:
    """The RayService's pod templates by group: `head`, then each worker group's name."""
    cluster = service["spec"]["rayClusterConfig"]
    return {
        "head": cluster["headGroupSpec"]["template"],
        **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]},
    }


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def volume_at(template: dict, container: dict, path: str) -> tuple[dict, dict] | None:
    """The (mount, volume) a file path of the container lies on: the deepest mount that contains it."""
    mounts = [m for m in container.get("volumeMounts", []) if PurePosixPath(path).is_relative_to(m["mountPath"])]
    if not mounts:
        return None
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    return mount, volumes[mount["name"]]
