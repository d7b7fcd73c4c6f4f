"""A client in another stack (Node's @grpc/grpc-js), built from the .proto files alone, gets the same answers."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc as pb_grpc

CLIENT = Path(__file__).resolve().parents[1] / "clients" / "node"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not (CLIENT / "node_modules" / "@grpc" / "grpc-js").exists(),
    reason="needs node and `make setup` (which installs the Node client's packages when node is present)",
)


def node(address: str, method: str, request: dict) -> object:
    result = subprocess.run(
        ["node", str(CLIENT / "client.js"), address, method, json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def stub(served):
    with grpc.insecure_channel(served[0]) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def test_node_client_gets_the_same_tokens_and_stats(served, stub):
    address, _ = served
    ask = {
        "prompt_token_ids": list(range(20, 40)),
        "sampling": {"max_tokens": 18, "ignore_eos": True},
        "speculation": {"num_speculative_tokens": 3},
    }
    want = stub.Generate(
        pb.GenerateRequest(
            prompt_token_ids=ask["prompt_token_ids"],
            sampling=pb.SamplingParams(max_tokens=18, ignore_eos=True),
            speculation=pb.SpeculationOptions(num_speculative_tokens=3),
        ),
        timeout=120,
    )
    got = node(address, "Generate", ask)
    assert got["token_ids"] == list(want.token_ids) and got["text"] == want.text
    assert got["finish_reason"] == "FINISH_REASON_LENGTH"
    assert got["speculation"]["accepted"] == want.speculation.accepted
    chunks = node(address, "GenerateStream", ask)
    assert [t for c in chunks for t in c["token_ids"]] == list(want.token_ids)
    assert chunks[-1]["usage"]["completion_tokens"] == 18


def test_node_client_sees_invalid_argument(served):
    got = node(served[0], "Generate", {"prompt": "x", "prompt_token_ids": [1]})
    assert got["error"]["code"] == "INVALID_ARGUMENT" and "prompt" in got["error"]["details"]
    info = node(served[0], "GetModelInfo", {})
    assert info["draft_method"] == "draft_model"
