"""Where the compiled kernels are cached: a directory of this user's, never the shared models volume."""

from __future__ import annotations

from pathlib import Path

from specdec_core import environment


def test_the_kernel_dir_is_never_under_specdec_home(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_HOME", "/models")
    monkeypatch.delenv("SPECDEC_KERNEL_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert environment.kernel_dir() == tmp_path / "home" / ".cache" / "specdec" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert environment.kernel_dir() == tmp_path / "xdg" / "specdec" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec says to ignore a relative path
    assert environment.kernel_dir() == tmp_path / "home" / ".cache" / "specdec" / "kernels"
    assert not environment.kernel_dir().is_relative_to(environment.specdec_home())


def test_specdec_kernel_dir_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("SPECDEC_KERNEL_DIR", str(tmp_path / "private"))
    assert environment.kernel_dir() == tmp_path / "private"
    monkeypatch.setenv("SPECDEC_KERNEL_DIR", "~/kernels")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert environment.kernel_dir() == Path(tmp_path / "home" / "kernels")
