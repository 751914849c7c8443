"""A refused run stays small: the two inputs that used to exhaust memory (a billion steps, an endless
prompt file) are exit 2 with one line, and the whole process peaks under 1 GB of resident memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEAK_BYTES = 10**9
A = ["--model", "tiny", "--height", "64", "--width", "64"]


# Runs the command as its child and prints that child's peak RSS: a child forked straight from this
# test process would count this process's pages until its exec (gigabytes late in the suite).
_MEASURE = (
    "import os, subprocess, sys\n"
    "proc = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)\n"
    "_, status, usage = os.wait4(proc.pid, 0)\n"
    "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)\n"  # KiB on Linux
)


def _peak_run(args: list[str], tmp_path: Path) -> tuple[int, str, int]:
    """Exit code, stderr and the peak RSS (bytes) of the console script run alone (os.wait4: that
    child's own rusage), measured from a small parent of its own."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
               FLUX2KLEIN_CACHE=str(tmp_path / "cache"), FLUX2KLEIN_COMPILE_CACHE=str(tmp_path / "store"))
    with open(tmp_path / "stderr", "wb") as err:
        done = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-m", "flux2klein_cli", *args],
                              env=env, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, cwd=tmp_path,
                              timeout=300, check=True)
    *printed, last = done.stdout.decode().splitlines() or [""]
    assert printed == []  # the command printed nothing on stdout
    code, peak = (int(v) for v in last.split())
    return code, (tmp_path / "stderr").read_text(), peak


@pytest.mark.slow
@pytest.mark.parametrize("extra, line", [
    (["a fox", "--steps", "1000000000"], "error: --steps must be at most 1000, got 1000000000"),
    (["--prompt-file", "/dev/zero", "--steps", "2"], "error: prompt file /dev/zero is larger than the limit of 1 MiB"),
], ids=["steps", "prompt-file"])
def test_a_refused_run_peaks_under_1_gb(extra: list[str], line: str, tmp_path: Path) -> None:
    code, err, peak = _peak_run(["generate", *A, *extra, "-o", str(tmp_path / "x.png")], tmp_path)
    assert (code, err.splitlines()) == (2, [line])
    assert peak < PEAK_BYTES, f"peak RSS {peak / 2**20:.0f} MiB"
    assert not (tmp_path / "x.png").exists()
