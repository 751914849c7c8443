"""`convert --layout orbax`: quiet on stderr, and an interrupt while Orbax writes leaves nothing
(Orbax writes from threads of its own, which must end before the temporary is removed)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flux2klein_cli.core import temporaries
from tests.test_interrupts import _assert_interrupted, _env, _interrupt, _start, _wait_for


@pytest.mark.slow
def test_orbax_convert_prints_no_absl_warnings(tiny_checkpoint: Path, tmp_path: Path) -> None:
    for extra in ([], ["--json"]):
        out = tmp_path / f"klein{len(extra)}"
        done = subprocess.run([sys.executable, "-m", "flux2klein_cli", "convert", str(tiny_checkpoint), "--layout",
                               "orbax", "--out", str(out), *extra], env=_env(tmp_path), capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert "absl" not in done.stderr and "target_byte_size" not in done.stderr, done.stderr[:2000]


@pytest.mark.slow
@pytest.mark.parametrize("component", ["transformer", "vae"])
def test_orbax_convert_interrupted_while_orbax_writes_leaves_nothing(tiny_checkpoint: Path, tmp_path: Path,
                                                                     component: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    args = ["convert", str(tiny_checkpoint), "--layout", "orbax", "--out", str(work / "klein"), "--json"]
    proc = _start(args, _env(tmp_path))
    _wait_for(proc, lambda: any(work.glob(f".klein{temporaries.MARK}*/{component}/orbax.partial_save*/*")),
              f"Orbax was writing the {component}")
    _assert_interrupted(*_interrupt(proc, signal.SIGINT))
    assert list(work.iterdir()) == []
