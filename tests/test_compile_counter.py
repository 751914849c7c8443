"""Zero recompiles: after `flux2klein compile`, a run loads the stored executables and JAX
compiles nothing at all, in the same process and in a new one, for text-to-image and for an
edit with two references of different sizes.

Counted with JAX's compile log (`jax_log_compiles`): every compilation, the pipeline's
programs and any eager operation alike (the pipeline has none between its programs: noise is
a stored program, arrays are placed with device_put). Without a store the same count sees
every program compile (the last test), so the count can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def worker(model: Path, store: Path, *extra: str, env: dict[str, str] | None = None) -> dict:
    env = env or dict(os.environ, JAX_PLATFORMS="cpu", FLUX2KLEIN_XLA_CACHE="off")
    done = subprocess.run([sys.executable, "-m", "tests.compile_counter_worker", str(model), str(store), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("edit", [False, True], ids=["text-to-image", "edit"])
def test_nothing_compiles_after_compile_in_this_or_a_new_process(tiny_checkpoint: Path, tmp_path: Path,
                                                                  edit: bool) -> None:
    store = tmp_path / "store"
    env = dict(os.environ, JAX_PLATFORMS="cpu", FLUX2KLEIN_XLA_CACHE="off")
    refs = ["--refs", "64x64,64x96"] if edit else []
    done = subprocess.run([sys.executable, "-m", "flux2klein_cli", "compile", "--model", str(tiny_checkpoint),
                           "--height", "64", "--width", "64", "--steps", "2", "--dtype", "fp32", "--cache-dir",
                           str(store), *refs, "--json"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    mode = ["--edit"] if edit else []
    programs = {"text_encoder", "noise", "denoise", "vae_decode"} | ({"vae_encode_64x64", "vae_encode_64x96"}
                                                                     if edit else set())

    # A new process: every program is a hit on what `compile` stored, nothing is compiled.
    later = worker(tiny_checkpoint, store, *mode)
    assert later["statuses"] == dict.fromkeys(programs, "hit")
    assert later["all_compiles"] == []

    # The same process that compiles (a fresh store): compiled up front, then none during the run.
    fresh = worker(tiny_checkpoint, tmp_path / "fresh", *mode)
    assert fresh["statuses"] == dict.fromkeys(programs, "miss")
    assert fresh["all_compiles"] == []


@pytest.mark.slow
def test_the_count_sees_compiles_without_a_store(tiny_checkpoint: Path, tmp_path: Path) -> None:
    counted = worker(tiny_checkpoint, tmp_path / "unused", "--no-store")
    assert len(counted["program_compiles"]) >= 4  # text encoder, noise, denoise loop, decoder


@pytest.mark.slow
def test_compile_on_a_mesh_then_run_on_it_compiles_nothing(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """`compile --mesh fsdp=2` on a host with 4 devices, then a run with `--mesh fsdp=2`: one
    parser and one choice of devices (the first two), so every program is a stored hit."""
    store = tmp_path / "store"
    env = dict(os.environ, JAX_PLATFORMS="cpu", FLUX2KLEIN_XLA_CACHE="off",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, "-m", "flux2klein_cli", "compile", "--model", str(tiny_checkpoint),
                           "--height", "64", "--width", "64", "--steps", "2", "--dtype", "fp32", "--cache-dir",
                           str(store), "--mesh", "fsdp=2", "--json"], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    later = worker(tiny_checkpoint, store, "--mesh", "fsdp=2", env=env)
    assert later["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1, "context": 1} and later["devices"] == [0, 1]
    assert later["statuses"] == dict.fromkeys({"text_encoder", "noise", "denoise", "vae_decode"}, "hit")
    assert later["all_compiles"] == []
