"""Either public API behind one call: `connect` opens the transport `--protocol` names, asks the server what it
serves, and hands back that answer and a `Send`, which builds one request, streams it and times it.

The clients that use it (`bench serve`, `bench sessions`) thus never know which API they load.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import grpc

from specdec_tools.loadgen.client import Sampling, build_request, stream_one
from specdec_tools.loadgen.metrics import RequestRecord
from specdec_tools.requests import GRPC_OPTIONS, Prompt, Speculation


class Unreachable(Exception):
    """The server did not say what it serves (GetModelInfo, GET /v1/models)."""


class Send(Protocol):
    def __call__(
        self,
        prompt: Prompt,
        index: int,
        sampling: Sampling,
        speculation: Speculation,
        *,
        history: Sequence[tuple[str, str]] = (),
        cache_salt: str = "",
    ) -> Awaitable[RequestRecord]:
        """Request `index` (its seed is sampling.seed + index): `prompt` as a user turn after the (role, content)
        messages of `history`, in the prefix-cache namespace `cache_salt` (empty: the shared one), streamed and
        timed. A failed request is a record with its error, never an exception."""


@asynccontextmanager
async def _grpc(address: str, auth_token: str | None, timeout_s: float) -> AsyncIterator[tuple[dict[str, Any], Send]]:
    from google.protobuf import json_format

    from specdec.v1 import generation_pb2 as pb
    from specdec.v1 import generation_pb2_grpc as pb_grpc

    metadata = [("authorization", f"Bearer {auth_token}")] if auth_token else None
    # One channel: every stream is multiplexed over one HTTP/2 connection, as a client library would do.
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        try:
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=min(timeout_s, 30.0), metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise Unreachable(
                f"--address {address}: GetModelInfo failed ({exc.code().name}: {exc.details()})"
            ) from None

        async def send(
            prompt: Prompt,
            index: int,
            sampling: Sampling,
            speculation: Speculation,
            *,
            history: Sequence[tuple[str, str]] = (),
            cache_salt: str = "",
        ) -> RequestRecord:
            request = build_request(prompt, index, sampling, speculation, history=history, cache_salt=cache_salt)
            return await stream_one(stub, request, timeout_s, metadata)

        yield json_format.MessageToDict(info, preserving_proto_field_name=True), send


@asynccontextmanager
async def _openai(address: str, auth_token: str | None, timeout_s: float) -> AsyncIterator[tuple[dict[str, Any], Send]]:
    from specdec_tools.loadgen.openai_http import OpenAIClient, chat_body  # aiohttp: only where it is used

    async with OpenAIClient(address, auth_token, timeout_s) as client:
        try:
            info = await client.model_info()
        except Exception as exc:
            raise Unreachable(f"--address {address}: GET /v1/models failed ({exc})") from None

        async def send(
            prompt: Prompt,
            index: int,
            sampling: Sampling,
            speculation: Speculation,
            *,
            history: Sequence[tuple[str, str]] = (),
            cache_salt: str = "",
        ) -> RequestRecord:
            body = chat_body(client.model, prompt, index, sampling, speculation, history=history, cache_salt=cache_salt)
            return await client.stream_one(body)

        yield info, send


# grpc: GenerateStream on the gRPC port; openai: streamed /v1/chat/completions on the HTTP port.
TRANSPORTS = {"grpc": _grpc, "openai": _openai}
PROTOCOLS = tuple(TRANSPORTS)


def connect(
    protocol: str, address: str, auth_token: str | None, timeout_s: float
) -> AbstractAsyncContextManager[tuple[dict[str, Any], Send]]:
    """`async with connect(...) as (server, send)`: `server` is what the server says it serves (GetModelInfo as a
    dict, or the model's card from GET /v1/models); raises Unreachable when it does not answer. The token goes as
    `authorization: Bearer TOKEN` (gRPC metadata or HTTP header); `timeout_s` bounds each request."""
    return TRANSPORTS[protocol](address, auth_token, timeout_s)
