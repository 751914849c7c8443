"""The executables' code fingerprint covers every module a trace may use: no hand-kept list."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import flux2klein_cli

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

PACKAGE = Path(flux2klein_cli.__file__).resolve().parent


def _fingerprint(root: Path) -> str:
    """code_fingerprint() as a fresh process importing the package copy under `root` computes it."""
    out = subprocess.run(
        [sys.executable, "-c", "import flux2klein_cli.core.compile.keys as k, flux2klein_cli as f; "
                               "print(f.__file__); print(k.code_fingerprint())"],
        cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True)
    where, digest = out.stdout.split()
    assert Path(where).resolve().is_relative_to(root.resolve()), where  # the copy, not the installed package
    return digest


def test_editing_a_traced_module_in_a_copy_gives_a_new_key(tmp_path: Path) -> None:
    copy = tmp_path / "flux2klein_cli"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = _fingerprint(tmp_path)
    # sharding.constrain runs inside every trace, and was missing from the old list.
    sharding = copy / "core" / "devices" / "sharding.py"
    sharding.write_text(sharding.read_text() + "\n# an edit\n")
    after_sharding = _fingerprint(tmp_path)
    assert after_sharding != before
    shim = copy / "core" / "models" / "cpu_kernels.cc"
    shim.write_text(shim.read_text() + "\n// an edit\n")
    assert _fingerprint(tmp_path) not in (before, after_sharding)


def test_the_fingerprint_is_stable_and_ignores_bytecode(tmp_path: Path) -> None:
    copy = tmp_path / "flux2klein_cli"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    first = _fingerprint(tmp_path)  # this import writes __pycache__ folders into the copy
    assert any(copy.rglob("*.pyc"))
    assert _fingerprint(tmp_path) == first
