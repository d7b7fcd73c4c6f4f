"""What one load point measured: per-request records in, the report's figures out. Pure functions, no I/O.

Names follow `vllm bench serve` where they overlap. Definitions (every time is measured by the client):

- TTFT, time to first token: from sending the request to the first stream chunk that carries tokens.
- E2EL, end-to-end latency: from sending the request to the end of its stream.
- ITL, inter-token latency: a chunk carries all the tokens of one round (several with speculation), so the time
  between two successive chunks is divided evenly over the tokens of the later chunk: a chunk of n tokens arriving
  g seconds after the previous one gives n latencies of g / n. A request's mean ITL is thus its decode time over
  the tokens after the first chunk, and speculation shows up as a shorter ITL, not as a few long gaps and many
  zero ones.
- TPOT, time per output token: (E2EL - TTFT) / (output tokens - 1), per request; requests of one token have none.
- Goodput: completed requests per second that meet every given SLO (ttft, tpot, e2el, in ms); with no SLO given,
  every completed request counts. A request without a TPOT (one token) meets a TPOT SLO.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it; times in seconds from the moment it was sent. Chunks without tokens (a
    final chunk that only carries the finish reason, say) are not recorded."""

    chunk_times: tuple[float, ...] = ()  # arrival of each chunk that carried tokens
    chunk_tokens: tuple[int, ...] = ()  # how many tokens each of those chunks carried
    e2el: float = 0.0  # the end of the stream
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the server read from its prefix cache
    text: str = ""  # the completion's text, every chunk's joined
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    error: str | None = None  # the gRPC status name when the request failed

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        return time_per_output_token(self.e2el, self.ttft, self.output_tokens)


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """One latency per token after the first chunk: the gap before chunk i spread evenly over its tokens."""
    latencies: list[float] = []
    for i in range(1, len(chunk_times)):
        gap, n = chunk_times[i] - chunk_times[i - 1], chunk_tokens[i]
        latencies.extend([gap / n] * n)
    return latencies


def time_per_output_token(e2el: float, ttft: float | None, output_tokens: int) -> float | None:
    if ttft is None or output_tokens < 2:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def distribution_ms(values_s: Iterable[float], name: str) -> dict[str, float]:
    """mean, median, p90 and p99 of `values_s` (seconds) in milliseconds, keyed like `mean_ttft_ms`; numpy's
    linear interpolation between closest ranks, as `vllm bench serve`. No values: zeros."""
    values = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    if values.size == 0:
        return {f"{stat}_{name}_ms": 0.0 for stat in ("mean", "median", "p90", "p99")}
    return {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(np.percentile(values, 50)),
        f"p90_{name}_ms": float(np.percentile(values, 90)),
        f"p99_{name}_ms": float(np.percentile(values, 99)),
    }


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Whether a request completed within every SLO given (milliseconds; keys among SLO_KEYS)."""
    if not record.ok:
        return False
    measured = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2el}
    for key, limit_ms in slos_ms.items():
        value = measured[key]
        if value is None and key == "tpot":
            continue
        if value is None or value * 1000.0 > limit_ms:
            return False
    return True


def errors_by_code(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failed requests counted by status name, names sorted; {} when none failed."""
    return dict(sorted(Counter(r.error for r in records if r.error is not None).items()))


def summarize(records: Sequence[RequestRecord], duration_s: float, slos_ms: Mapping[str, float]) -> dict[str, object]:
    """The report's figures for one mode of one load point. `duration_s` (`duration` in the report): from the first
    request sent to the last stream ended. Throughputs count completed requests only; `output_tokens_per_s` is
    `output_throughput` under the name this project's reports use."""
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    proposed, accepted, rounds = (sum(getattr(r, f) for r in done) for f in ("proposed", "accepted", "rounds"))
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    figures: dict[str, object] = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": errors_by_code(records),
        "duration": duration_s,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output_tokens),
        "output_tokens_per_s": per_s(output_tokens),
        "total_token_throughput": per_s(output_tokens + sum(r.prompt_tokens for r in done)),
        "good_requests": sum(meets_slos(r, slos_ms) for r in done),
    }
    figures["request_goodput"] = per_s(figures["good_requests"])
    figures.update(distribution_ms((r.ttft for r in done if r.ttft is not None), "ttft"))
    figures.update(distribution_ms((r.tpot for r in done if r.tpot is not None), "tpot"))
    figures.update(
        distribution_ms((x for r in done for x in inter_token_latencies(r.chunk_times, r.chunk_tokens)), "itl")
    )
    figures.update(distribution_ms((r.e2el for r in done), "e2el"))
    figures.update(
        {
            "rounds": rounds,
            "proposed": proposed,
            "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            # The first token of a request comes from prefill, not from a round.
            "mean_tokens_per_round": (output_tokens - len(done)) / rounds if rounds else 0.0,
        }
    )
    return figures
