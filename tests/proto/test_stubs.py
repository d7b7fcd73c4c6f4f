"""The checked-in Python stubs are exactly what grpcio-tools generates from the .proto files."""

from __future__ import annotations

import filecmp
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"


def test_checked_in_stubs_match_the_protos(tmp_path):
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "specdec" / "v1").glob("*.proto"))
    assert protos, "no .proto files found"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        *protos,
    ]
    assert protoc.main(args) == 0
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated
    for rel in generated:
        checked_in = PROTO_ROOT / rel
        assert checked_in.exists(), f"{rel} is generated but not checked in: run `make proto`"
        assert filecmp.cmp(tmp_path / rel, checked_in, shallow=False), f"{rel} is stale: run `make proto`"
