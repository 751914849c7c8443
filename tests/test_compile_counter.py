"""Zero recompiles: after `flux2klein compile`, a run loads the stored executables and JAX
compiles none of the pipeline's programs, in the same process and in a new one.

Counted with JAX's compile log (`jax_log_compiles`), restricted to the pipeline's jitted
programs; the few tiny eager operations around them (drawing noise, a reshape) are compiled
by JAX itself and served from its persistent cache in later runs. Without a store the same
count sees every program compile (the last test), so the count can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(model: Path, store: Path, *extra: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", FLUX2KLEIN_XLA_CACHE="off")
    done = subprocess.run([sys.executable, "-m", "tests.compile_counter_worker", str(model), str(store), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_no_program_compiles_after_compile_in_this_or_a_new_process(tiny_checkpoint: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    env = dict(os.environ, JAX_PLATFORMS="cpu", FLUX2KLEIN_XLA_CACHE="off")
    done = subprocess.run([sys.executable, "-m", "flux2klein_cli", "compile", "--model", str(tiny_checkpoint),
                           "--height", "64", "--width", "64", "--steps", "2", "--dtype", "fp32", "--cache-dir",
                           str(store), "--json"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    # A new process: every program is a hit on what `compile` stored, nothing is compiled.
    later = worker(tiny_checkpoint, store)
    assert later["statuses"] == {"text_encoder": "hit", "denoise": "hit", "vae_decode": "hit"}
    assert later["program_compiles"] == []

    # The same process that compiles (a fresh store): compiled up front, then none during the run.
    fresh = worker(tiny_checkpoint, tmp_path / "fresh")
    assert set(fresh["statuses"].values()) == {"miss"}
    assert fresh["program_compiles"] == []


def test_the_count_sees_compiles_without_a_store(tiny_checkpoint: Path, tmp_path: Path) -> None:
    counted = worker(tiny_checkpoint, tmp_path / "unused", "--no-store")
    assert len(counted["program_compiles"]) >= 3  # text encoder, denoise loop, decoder
