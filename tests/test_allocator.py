"""The console entry sets glibc's malloc so that a block freed by one program call is the next call's,
not fresh pages faulted in again (core/devices/runtime.py: tune_allocator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flux2klein_cli.core.devices.runtime import has_glibc_malloc

GLIBC_ONLY = pytest.mark.skipif(not has_glibc_malloc(), reason="glibc's malloc only")
ROOT = Path(__file__).resolve().parents[1]
BLOCK_PAGES = (64 << 20) // os.sysconf("SC_PAGE_SIZE")

# Page faults of each of four rounds in a new thread (as XLA's threads allocate a call's temporaries):
# a 64 MiB block allocated, written through and freed. `plain`: as the C library comes; `tuned`:
# after tune_allocator(); `console`: the rounds run at exit of the console entry's process
# (`console-compile`: of one running `compile`, which keeps glibc's settings).
ROUNDS = """
import ctypes, json, resource, sys, threading

def rounds():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    faults = []

    def work():
        for _ in range(4):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            block = libc.malloc(64 << 20)
            ctypes.memset(block, 1, 64 << 20)
            libc.free(block)
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return faults

mode = sys.argv[1]
if mode in ("console", "console-compile"):
    import atexit
    atexit.register(lambda: print(json.dumps(rounds()), file=sys.__stderr__))
    sys.argv = ["flux2klein", "--version"] if mode == "console" else ["flux2klein", "compile", "--help"]
    from flux2klein_cli.cli.main import console
    console()
if mode == "tuned":
    from flux2klein_cli.core.devices.runtime import tune_allocator
    print(json.dumps(tune_allocator()), file=sys.stderr)
print(json.dumps(rounds()), file=sys.stderr)
"""


def run_rounds(mode: str, **env: str) -> list[list]:
    """What the rounds' process printed on stderr, one JSON value a line."""
    mine = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, timeout=120,
                          env={**mine, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stderr.strip().splitlines() if line.startswith("[")]


def faults_per_round(mode: str) -> list[int]:
    return run_rounds(mode)[-1]


@GLIBC_ONLY
def test_a_freed_block_is_the_next_rounds_without_new_page_faults() -> None:
    plain = faults_per_round("plain")
    if min(plain[1:]) < BLOCK_PAGES // 2:  # the control: each round faults the block in again, so the check can fail
        pytest.skip(f"this C library already keeps freed blocks here ({plain} page faults a round)")
    for mode in ("tuned", "console"):
        tuned = faults_per_round(mode)
        assert max(tuned[1:]) < BLOCK_PAGES // 10, (mode, tuned, plain)
    # `compile` runs no image: its parallel compiles keep an arena each, so its blocks are glibc's
    untuned = faults_per_round("console-compile")
    assert min(untuned[1:]) >= BLOCK_PAGES // 2, (untuned, plain)


@GLIBC_ONLY
def test_malloc_settings_the_user_made_are_left_as_they_are() -> None:
    assert run_rounds("tuned")[0] == ["MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"]
    assert run_rounds("tuned", MALLOC_ARENA_MAX="4")[0] == ["MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"]
    set_by_tunables, rounds = run_rounds("tuned", GLIBC_TUNABLES="glibc.malloc.mmap_max=8:glibc.malloc.arena_max=2")
    assert set_by_tunables == ["MALLOC_TRIM_THRESHOLD_"]
    # The user's own settings hold: with mappings allowed again, each round faults its block in anew.
    if min(faults_per_round("plain")[1:]) >= BLOCK_PAGES // 2:
        assert min(rounds[1:]) >= BLOCK_PAGES // 2, rounds
