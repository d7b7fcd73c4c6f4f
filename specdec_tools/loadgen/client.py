"""The load itself: streamed requests over grpc.aio, kept N in flight (closed loop) or sent at random arrival times
(open loop). Every function here times from the client's side; the math over the records is in metrics.py."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc
import numpy as np

from specdec.v1 import generation_pb2 as pb
from specdec_tools.loadgen.metrics import RequestRecord
from specdec_tools.requests import Prompt, Speculation, generate_request

Send = Callable[[int], Awaitable[RequestRecord]]  # request index -> its record


@dataclass(frozen=True)
class Sampling:
    temperature: float
    seed: int  # request i is sampled with seed + i, in every mode, so both modes draw alike
    ignore_eos: bool


def build_request(
    prompt: Prompt,
    index: int,
    sampling: Sampling,
    speculation: Speculation,
    *,
    history: Sequence[tuple[str, str]] = (),
    cache_salt: str = "",
) -> pb.GenerateRequest:
    """Request `index`: the prompt as one user turn, after the (role, content) messages of `history` when there
    are any (then sent as `messages`; either way the server applies the chat template)."""
    text, messages = (None, [*history, ("user", prompt.text)]) if history else (prompt.text, ())
    return generate_request(
        text,
        messages=messages,
        temperature=sampling.temperature,
        seed=sampling.seed + index,
        max_tokens=prompt.max_tokens,
        ignore_eos=sampling.ignore_eos,
        speculation=speculation,
        cache_salt=cache_salt,
    )


async def stream_one(
    stub: Any, request: pb.GenerateRequest, timeout_s: float, metadata: Sequence[tuple[str, str]] | None
) -> RequestRecord:
    """Send one GenerateStream request and time its chunks. A failed call is a record with its status name."""
    start = time.perf_counter()
    times: list[float] = []
    tokens: list[int] = []
    text: list[str] = []
    last = None
    try:
        async for chunk in stub.GenerateStream(request, timeout=timeout_s, metadata=metadata):
            if chunk.token_ids:
                times.append(time.perf_counter() - start)
                tokens.append(len(chunk.token_ids))
            text.append(chunk.text)
            last = chunk
    except grpc.aio.AioRpcError as exc:
        return RequestRecord(e2el=time.perf_counter() - start, error=exc.code().name)
    e2el = time.perf_counter() - start
    if last is None or last.finish_reason == pb.FINISH_REASON_ERROR:
        return RequestRecord(e2el=e2el, error="FINISH_REASON_ERROR" if last is not None else "EMPTY_STREAM")
    stats = last.speculation
    return RequestRecord(
        chunk_times=tuple(times),
        chunk_tokens=tuple(tokens),
        e2el=e2el,
        prompt_tokens=last.usage.prompt_tokens,
        cached_tokens=last.usage.cached_tokens,
        text="".join(text),
        rounds=stats.rounds,
        proposed=stats.proposed,
        accepted=stats.accepted,
    )


def inter_arrival_times(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Seconds between request arrivals: gamma-distributed with shape `burstiness` and mean 1 / `rate`, as in
    `vllm bench serve` (burstiness 1 is exponential, i.e. Poisson arrivals; below 1 burstier, above 1 more even).
    rate = inf sends everything at once."""
    rng = np.random.default_rng(seed)
    while True:
        yield 0.0 if math.isinf(rate) else float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


async def closed_loop(
    send: Send, concurrency: int, num_requests: int | None, deadline: float | None, on_done: Callable[[], None]
) -> list[RequestRecord]:
    """Keep `concurrency` requests in flight: each finished one is replaced at once, until `num_requests` were
    sent or `deadline` (perf_counter seconds) has passed; in-flight requests then finish."""
    indices = itertools.count()  # shared by the workers: one event loop, so no lock
    records: list[RequestRecord] = []

    async def worker() -> None:
        while deadline is None or time.perf_counter() < deadline:
            index = next(indices)
            if num_requests is not None and index >= num_requests:
                return
            records.append(await send(index))
            on_done()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


async def open_loop(
    send: Send, gaps: Iterator[float], num_requests: int | None, deadline: float | None, on_done: Callable[[], None]
) -> list[RequestRecord]:
    """Send request i at its arrival time, whatever is still in flight; the first goes at once. Stops sending
    after `num_requests` or at `deadline`; in-flight requests then finish."""
    tasks: list[asyncio.Task] = []
    arrival = time.perf_counter()
    for index in itertools.count():
        if (num_requests is not None and index >= num_requests) or (deadline is not None and arrival >= deadline):
            break
        await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        task = asyncio.create_task(send(index))
        task.add_done_callback(lambda _: on_done())
        tasks.append(task)
        arrival += next(gaps)
    return list(await asyncio.gather(*tasks))


# -- load points ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Concurrency:
    """A closed-loop load point: `value` streams kept in flight."""

    key: ClassVar[str] = "concurrency"  # its key in the report's points
    value: int

    @property
    def label(self) -> str:
        return f"concurrency {self.value}"

    @property
    def report_value(self) -> int:
        return self.value

    @property
    def min_requests(self) -> int:
        return self.value

    async def drive(
        self, send: Send, num_requests: int | None, deadline: float | None, on_done: Callable[[], None]
    ) -> list[RequestRecord]:
        return await closed_loop(send, self.value, num_requests, deadline, on_done)


@dataclass(frozen=True)
class RequestRate:
    """An open-loop load point: `value` requests per second on average, arrivals drawn by inter_arrival_times."""

    key: ClassVar[str] = "request_rate"
    value: float
    burstiness: float = 1.0
    seed: int = 0

    @property
    def label(self) -> str:
        return f"rate {self.value:g}/s"

    @property
    def report_value(self) -> float | str:
        return "inf" if math.isinf(self.value) else self.value  # JSON has no infinity

    @property
    def min_requests(self) -> int:
        return 0

    async def drive(
        self, send: Send, num_requests: int | None, deadline: float | None, on_done: Callable[[], None]
    ) -> list[RequestRecord]:
        gaps = inter_arrival_times(self.value, self.burstiness, self.seed)
        return await open_loop(send, gaps, num_requests, deadline, on_done)


Load = Concurrency | RequestRate
LOADS = (Concurrency, RequestRate)
