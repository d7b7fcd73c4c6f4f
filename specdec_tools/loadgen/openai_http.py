"""The load generator's other transport: the OpenAI-compatible HTTP API (`--protocol openai`).

Each prompt is sent as one user turn (after the conversation so far, for `bench sessions`) to `/v1/chat/completions`
with `stream: true` (the server applies the chat template, as gRPC does to a `prompt`), asking for
`return_token_ids` so that every chunk's token count is exact and `stream_options.include_usage` for the final usage
(cached prompt tokens included) and speculation figures.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from specdec_tools.loadgen.client import Sampling
from specdec_tools.loadgen.metrics import RequestRecord
from specdec_tools.requests import Prompt, Speculation


def base_url(address: str) -> str:
    """`HOST:PORT` or a URL, as the API's base (ending in /v1)."""
    url = address if "://" in address else f"http://{address}"
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def chat_body(
    model: str,
    prompt: Prompt,
    index: int,
    sampling: Sampling,
    speculation: Speculation,
    *,
    history: Sequence[tuple[str, str]] = (),
    cache_salt: str = "",
) -> dict[str, Any]:
    """Request `index` as a streamed chat completion: the (role, content) messages of `history`, then the prompt as
    a user turn; the same request as loadgen.client.build_request over gRPC."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": role, "content": content} for role, content in [*history, ("user", prompt.text)]],
        "max_tokens": prompt.max_tokens,
        "temperature": sampling.temperature,
        "seed": sampling.seed + index,
        "ignore_eos": sampling.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if speculation is not None:
        body["num_speculative_tokens"] = speculation
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


class OpenAIClient:
    """One aiohttp session for the whole run (connections are reused, as a client library would)."""

    def __init__(self, address: str, auth_token: str | None, timeout_s: float) -> None:
        self.base = base_url(address)
        self.headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.model = ""

    async def __aenter__(self) -> OpenAIClient:
        self.session = aiohttp.ClientSession(headers=self.headers, timeout=self.timeout)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.session is not None
        await self.session.close()

    async def model_info(self) -> dict[str, Any]:
        """The served model's card (GET /v1/models); remembers its id for the requests."""
        assert self.session is not None
        async with self.session.get(f"{self.base}/models") as response:
            body = await response.json(content_type=None)
            if response.status != 200:
                raise RuntimeError(f"GET {self.base}/models: {response.status} {body}")
        card = body["data"][0]
        self.model = card["id"]
        return card

    async def stream_one(self, body: dict[str, Any]) -> RequestRecord:
        """POST one streamed chat completion and time its chunks; a failure is a record with its HTTP status (or
        the error event's type, for a failure after the stream began)."""
        assert self.session is not None
        start = time.perf_counter()
        times: list[float] = []
        tokens: list[int] = []
        text: list[str] = []
        final: dict[str, Any] | None = None
        try:
            async with self.session.post(f"{self.base}/chat/completions", json=body) as response:
                if response.status != 200:
                    return RequestRecord(e2el=time.perf_counter() - start, error=f"HTTP_{response.status}")
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        return RequestRecord(
                            e2el=time.perf_counter() - start, error=event["error"].get("type", "error")
                        )
                    choices = event.get("choices", [])
                    ids = [t for choice in choices for t in choice.get("token_ids", ())]
                    text.extend(choice.get("delta", {}).get("content") or "" for choice in choices)
                    if ids:
                        times.append(time.perf_counter() - start)
                        tokens.append(len(ids))
                    if event.get("usage"):
                        final = event
        except (aiohttp.ClientError, TimeoutError) as exc:
            return RequestRecord(e2el=time.perf_counter() - start, error=type(exc).__name__)
        e2el = time.perf_counter() - start
        if final is None:
            return RequestRecord(e2el=e2el, error="NO_USAGE_CHUNK")
        spec, usage = final.get("speculation", {}), final["usage"]
        return RequestRecord(
            chunk_times=tuple(times),
            chunk_tokens=tuple(tokens),
            e2el=e2el,
            prompt_tokens=usage["prompt_tokens"],
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            text="".join(text),
            rounds=spec.get("rounds", 0),
            proposed=spec.get("proposed", 0),
            accepted=spec.get("accepted", 0),
        )
