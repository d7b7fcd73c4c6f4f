"""The ASGI app of the OpenAI-compatible API: routes, server-sent events, and OpenAI's error bodies.

Built once per router replica (`build_http_app(router)`) and served by Serve's HTTP proxy next to the gRPC API;
every route goes through the router's `generate`, the path gRPC requests take.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deployments.generation_codec import MAX_JSON_DEPTH, GenerateCall
from deployments.openai import codec
from deployments.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from deployments.openai.tool_parser import ToolCallParser
from deployments.openai.tools import ToolCallFormat
from deployments.status import UnknownModel, status_of
from specdec_core.errors import InvalidArgument, ResourceExhausted
from specdec_core.outputs import RequestOutput

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024  # as the gRPC API's message limit


class Backend(Protocol):
    """What the HTTP API needs of the router."""

    served_model_name: str
    max_model_len: int
    default_max_tokens: int
    started_at: int
    tool_call_format: ToolCallFormat  # how a grammar spells the served tokenizer's call markers

    def authenticate(self, metadata: Sequence[tuple[str, str]]) -> None:
        """Raise `Unauthenticated` unless the headers carry the server's bearer token (when it has one)."""

    def generate(
        self, call: GenerateCall, request_id: str, metadata: Sequence[tuple[str, str]]
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for `call`; typed errors (InvalidArgument, ResourceExhausted, ...) otherwise."""

    def refused(self, error: BaseException) -> None:
        """Count a completion request refused before `generate` (which counts the rest): by its token, its body."""

    def with_variant(self, call: GenerateCall) -> GenerateCall:
        """`call` with its draft variant assigned (checked where it names one)."""


def build_http_app(backend: Backend) -> Starlette:
    def guarded(
        handler: Callable[[Request], Awaitable[Response]], completes: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        """Check the bearer token first; every failure answers in OpenAI's error format. A completion route's request
        without the token is counted as refused."""

        async def route(request: Request) -> Response:
            try:
                backend.authenticate(list(request.headers.items()))
            except Exception as exc:
                if completes:
                    backend.refused(exc)
                return error_response(exc)
            try:
                return await handler(request)
            except Exception as exc:
                return error_response(exc)

        return route

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_card(backend)]})

    async def model(request: Request) -> Response:
        _check_model(backend, request.path_params["model"])
        return JSONResponse(_card(backend))

    async def chat(request: Request) -> Response:
        return await _complete(backend, request, chat=True)

    async def completions(request: Request) -> Response:
        return await _complete(backend, request, chat=False)

    async def health(request: Request) -> Response:
        # vLLM's liveness route, which load harnesses (guidellm) probe before they start; no token needed.
        return Response(status_code=200)

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", guarded(models), methods=["GET"]),
            Route("/v1/models/{model:path}", guarded(model), methods=["GET"]),
            Route("/v1/chat/completions", guarded(chat, completes=True), methods=["POST"]),
            Route("/v1/completions", guarded(completions, completes=True), methods=["POST"]),
        ]
    )


def _card(backend: Backend) -> dict[str, Any]:
    return codec.model_card(backend.served_model_name, backend.started_at, "specdec", backend.max_model_len)


def _check_model(backend: Backend, name: str) -> None:
    if name != backend.served_model_name:
        raise UnknownModel(f"the model {name!r} does not exist; this server serves {backend.served_model_name!r}")


async def _complete(backend: Backend, request: Request, chat: bool) -> Response:
    try:
        call = await _decode(backend, request, chat)
        call = replace(call, generate=backend.with_variant(call.generate))
    except Exception as exc:
        backend.refused(exc)
        raise
    response_id = codec.new_id(call)
    outputs = backend.generate(call.generate, response_id, list(request.headers.items()))
    try:
        first = await anext(outputs)  # refusals (admission, a prompt too long) are still a status code here
    except InvalidArgument as exc:
        if chat and exc.field in ("prompt", "prompt_token_ids"):  # a chat request's prompt is its messages
            raise InvalidArgument("messages", exc.message) from None
        raise
    if not call.stream:
        collected = [first] + [o async for o in outputs]
        return JSONResponse(codec.response(call, response_id, collected))
    return StreamingResponse(
        _events(call, response_id, first, outputs),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _decode(backend: Backend, request: Request, chat: bool) -> codec.Call:
    body = await _json_body(request)
    if chat:
        call = codec.decode_chat(
            parse_body(ChatCompletionRequest, body), backend.default_max_tokens, backend.tool_call_format
        )
    else:
        call = codec.decode_completion(parse_body(CompletionRequest, body))
    _check_model(backend, call.model)
    return call


async def _json_body(request: Request) -> Any:
    """The body, parsed. One over MAX_BODY_BYTES is refused unread where its declared length says so, else as soon
    as that many bytes have come: it is never held whole. (The prompt in it has its own, smaller limit:
    `router.max_prompt_bytes`, checked before tokenizing.)"""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise InvalidArgument("body", f"{declared} bytes; at most {MAX_BODY_BYTES}")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise InvalidArgument("body", f"more than {MAX_BODY_BYTES} bytes; at most {MAX_BODY_BYTES}")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument("body", f"not valid JSON: {exc}") from None
    except RecursionError:  # the parser recurses once a level; shallower bodies are bounded by `parse_body`
        raise InvalidArgument("body", f"nesting deeper than {MAX_JSON_DEPTH} levels") from None


async def _events(
    call: codec.Call, response_id: str, first: RequestOutput, rest: AsyncIterator[RequestOutput]
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per round (with tools, per piece of content or call it decided), the usage chunk
    when asked, then `data: [DONE]`. A failure after the first byte can no longer change the status: it is sent as
    an error event before [DONE]."""
    opening = codec.first_chunk(call, response_id)
    if opening is not None:
        yield _event(opening)
    parser = ToolCallParser(call.tools) if call.tools is not None else None
    last = first
    try:
        output: RequestOutput | None = first
        while output is not None:
            last = output
            for body in codec.chunks(call, response_id, output, parser):
                yield _event(body)
            output = await anext(rest, None)
        if call.include_usage:
            yield _event(codec.usage_chunk(call, response_id, last))
    except Exception as exc:
        yield _event(error_body(exc)[1])
    yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI's error body) for a failure."""
    if isinstance(exc, UnknownModel):
        return 404, _error(str(exc), "invalid_request_error", "model", "model_not_found")
    status = status_of(exc)
    if isinstance(exc, (InvalidArgument, ResourceExhausted)):
        param = codec.http_param(exc.field)
        return status.http, _error(f"{param}: {exc.message}", status.openai_type, param, status.grpc.name.lower())
    if status.http == 500:
        log.error("request failed", exc_info=exc)
    return status.http, _error(str(exc) or type(exc).__name__, status.openai_type, None, status.grpc.name.lower())


def _error(message: str, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    # A message or param may quote the request (a key, a value), lone surrogates included, which no UTF-8 body can
    # hold: they are written as their escapes, so that the error itself never fails.
    return {"error": {"message": _printable(message), "type": kind, "param": param and _printable(param), "code": code}}


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body, status_code=status)
