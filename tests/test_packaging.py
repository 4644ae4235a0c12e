"""The wheel installs one import name, `symbiont` (and the `base-executor` script), so it sits beside
proto-plus (import name `proto`, in every Google Cloud library) and any project's `client`."""
from __future__ import annotations

import os
import pathlib
import site
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

# what a fresh venv holds at the top of site-packages before anything is installed
_VENV_OWN = {"pip", "setuptools", "_distutils_hack", "distutils-precedence.pth", "pkg_resources", "__pycache__"}


def _run(*cmd, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_wheel_installs_one_name_beside_proto_plus(tmp_path: pathlib.Path):
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), REPO)
    wheel = next((tmp_path / "dist").glob("symbiont-*.whl"))
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    target = pathlib.Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    before = {p.name for p in target.iterdir()}
    _run(py, "-m", "pip", "install", "-q", "--no-deps", str(wheel))
    ours = {p.name for p in target.iterdir()} - before
    assert {n for n in ours if not n.endswith(".dist-info")} == {"symbiont"}, f"the wheel put {sorted(ours)} at the top"
    _run(py, "-m", "pip", "install", "-q", "proto-plus")
    # our dependencies (torch, transformers, ...) come from this test's environment, after the venv's own
    (target / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    probe = (
        "import proto, symbiont\n"
        "from symbiont import connect, virtualize\n"
        "from symbiont.errors import SymbiontError\n"
        "import symbiont.base_executor.cli, symbiont.proto.executor_pb2\n"
        "from symbiont.proto import _doorbell\n"
        "assert proto.Message and proto.Field, proto.__file__\n"
        "assert symbiont.__file__.startswith(r'%s'), symbiont.__file__\n"
        "print(proto.__file__, symbiont.__file__)\n" % target
    )
    out = _run(py, "-c", probe, cwd=str(tmp_path))  # (not the repository: its folders must not be found)
    assert str(target / "proto" / "__init__.py") in out  # proto-plus owns `proto`
    models = _run(str(venv / "bin" / "base-executor"), "models", cwd=str(tmp_path))
    assert "tiny-llama" in models
