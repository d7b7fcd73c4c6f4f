"""`specdec generate` against the served stack: it prints what the server's Generate returns, and the stats."""

from __future__ import annotations

import subprocess
import sys

import grpc

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc as pb_grpc


def test_specdec_generate_prints_the_text_and_the_stats(served):
    address, _ = served
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec_tools.cli",
            "generate",
            "--address",
            address,
            "--max-tokens",
            "6",
            "--stream",
            "--num-speculative-tokens",
            "2",
            "hello there",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    request = pb.GenerateRequest(
        prompt="hello there",
        sampling=pb.SamplingParams(max_tokens=6),
        speculation=pb.SpeculationOptions(num_speculative_tokens=2),
    )
    with grpc.insecure_channel(address) as channel:
        want = pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60)
    assert result.stdout.rstrip("\n") == want.text.rstrip("\n")
    assert "proposed" in result.stderr and "accepted" in result.stderr


def test_specdec_generate_sends_speculation_method(served):
    """`none` is plain decoding (nothing proposed); a method the server does not run is refused naming the field."""
    address, _ = served
    command = [sys.executable, "-m", "specdec_tools.cli", "generate", "--address", address, "--max-tokens", "6"]
    plain = subprocess.run(
        [*command, "--speculation-method", "none", "hello there"], capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 0, plain.stderr
    assert "proposed 0," in plain.stderr, plain.stderr
    refused = subprocess.run(
        [*command, "--speculation-method", "suffix", "hello there"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0 and "speculation_method" in refused.stderr
