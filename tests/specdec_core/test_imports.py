"""specdec_core is a pure engine: it imports and runs with ray and grpc unavailable."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_core_imports_without_ray_or_grpc():
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("ray", "grpc", "grpcio"):
                    raise ImportError(f"{name} is blocked in this test")
                return None

        sys.meta_path.insert(0, Block())
        import pkgutil, importlib, specdec_core
        for module in pkgutil.walk_packages(specdec_core.__path__, "specdec_core."):
            importlib.import_module(module.name)
        assert not any(m.split(".")[0] in ("ray", "grpc") for m in sys.modules), "ray or grpc got imported"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
