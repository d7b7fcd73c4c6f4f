"""Per-request settings, validated when they are built: a bad value fails before any work starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from specdec_core.errors import InvalidArgument
from specdec_core.grammar.constraint import Constraint

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_SEED = 2**63 - 1
# Temperatures in (0, this) are refused: near 0, logits / temperature overflows float32 (at 1e-38 a logit of 3.4
# already does), inf - inf is NaN and the sampled token is garbage. At 1e-3 any logit below 3.4e35 stays finite;
# 0 asks for greedy decoding, the limit such temperatures approach. float32(1e-3) rounds up, so 0.001 sent as the
# wire's float32 (client -> router -> workers) passes too; float32(1e-2) would round down and fail.
MIN_TEMPERATURE = 1e-3
# The sampler holds temperature and top_p as float32 (in process and on the workers alike), so a value is accepted only
# where float32 keeps its meaning: a temperature past float32's largest is inf there (logits / inf, and -inf / inf is
# NaN under a grammar's mask); a top_p below float32's smallest normal number is 0 there or a subnormal some devices
# flush to 0, and a top_p of 0 keeps no token (NaN). Any top_p below 1 / vocabulary keeps only the most likely token
# anyway, so MIN_TOP_P asks for nothing a smaller one could.
MAX_TEMPERATURE = 3.4028234663852886e38  # float32's largest finite value
MIN_TOP_P = 2.0**-126  # float32's smallest normal value, exact in float32 and in double
# top_k as large as int32 holds: every signed and unsigned 32-bit wire carries it, and it is far past any vocabulary,
# so every accepted k keeps the sampler's one meaning (k >= V is off). A larger one is refused, not clamped: 2**40 is
# a client's bug more likely than a request for "off", and the edge names such values rather than rewriting them.
MAX_TOP_K = 2**31 - 1


@dataclass(frozen=True)
class TokenShaping:
    """How a distribution is shaped before sampling from it (`sampling.processed_probs`): all that the workers
    need of a request's settings. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        _check_shaping(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: the token shaping (see `TokenShaping`), then the request's seed and stopping rules, and
    the language the output must belong to (`constraint`, None: any text). A constrained output ends where its
    grammar does: eos is allowed only where the grammar can end, and is the only token allowed once it must. So
    `ignore_eos` with a constraint is refused: an output past its end could only repeat eos."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        _check_shaping(self.temperature, self.top_p, self.top_k)
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgument("seed", f"must be in [0, 2**63 - 1], got {self.seed}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidArgument("max_tokens", f"must be an integer > 0, got {self.max_tokens}")
        stops = tuple(dict.fromkeys(self.stop))  # duplicates are harmless: drop them, keep order
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InvalidArgument("stop", "stop strings must be non-empty strings")
            if len(s) > MAX_STOP_LENGTH:
                raise InvalidArgument("stop", f"a stop string is longer than {MAX_STOP_LENGTH} characters")
        object.__setattr__(self, "stop", stops)
        if self.constraint is not None and self.ignore_eos:
            raise InvalidArgument(
                "ignore_eos",
                f"cannot be set with a {self.constraint.kind} constraint: the output ends where the grammar does",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @cached_property
    def shaping(self) -> TokenShaping:
        # Read for every sequence every round (verify items, draft requests): built and checked once.
        return TokenShaping(self.temperature, self.top_p, self.top_k)


def _check_shaping(temperature: float, top_p: float, top_k: int) -> None:
    _check_finite("temperature", temperature)
    if temperature < 0:
        raise InvalidArgument("temperature", f"must be >= 0, got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise InvalidArgument("temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}")
    if temperature > MAX_TEMPERATURE:
        raise InvalidArgument(
            "temperature", f"must be at most {MAX_TEMPERATURE} (float32's largest), got {temperature}"
        )
    _check_finite("top_p", top_p)
    if not 0 < top_p <= 1:
        raise InvalidArgument("top_p", f"must be in (0, 1], got {top_p}")
    if top_p < MIN_TOP_P:
        raise InvalidArgument("top_p", f"must be at least 2**-126 (float32's smallest normal), got {top_p}")
    if not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        raise InvalidArgument("top_k", f"must be an integer in [0, 2**31 - 1] (0 = off), got {top_k}")


def _check_finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(name, f"must be a finite number, got {value!r}")


AUTO = "auto"


def parse_num_speculative_tokens(value: int | str | None, max_k: int) -> int | str | None:
    """`auto`, an integer in [0, max_k] (0 = plain decoding), or None (the server's default)."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise InvalidArgument("num_speculative_tokens", f"must be an integer or 'auto', got {value!r}")
        value = int(value)
    if not isinstance(value, int) or not 0 <= value <= max_k:
        raise InvalidArgument("num_speculative_tokens", f"must be in [0, {max_k}] or 'auto', got {value!r}")
    return value
