"""Every executable the store writes runs in a new process, even when jax's persistent XLA
cache served the compile (on CPU such an executable has no kernels to serialize)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

# One program in the store's terms; `cache` turns jax's persistent cache on first.
_PROGRAM = """
import sys, json, numpy as np, jax, jax.numpy as jnp
if sys.argv[2] != "-":
    jax.config.update("jax_compilation_cache_dir", sys.argv[2])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from flux2klein_cli.core.compile.store import ExecutableStore
from flux2klein_cli.core.compile.target import ProgramSpec

def wave(x):
    return jnp.sin(x) * 2.0 + jnp.cos(x) ** 2

spec = ProgramSpec("wave", jax.jit(wave), (jax.ShapeDtypeStruct((64,), jnp.float32),), {"v": 1})
warnings = []
store = ExecutableStore(sys.argv[1], on_warning=warnings.append)
if sys.argv[3] == "jit":  # a plain jitted call first, as a command's eager work would
    jax.jit(wave)(jnp.zeros(64, jnp.float32)).block_until_ready()
compiled, info = store.load_or_compile(spec)
out = compiled(np.linspace(0, 1, 64, dtype=np.float32))
print(json.dumps({"status": info.status, "saved": info.saved, "warnings": warnings,
                  "sum": float(np.asarray(out).sum())}))
"""


def _run(store: Path, cache: Path | None, first: str = "store") -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, str(store), str(cache) if cache else "-", first],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_executable_jax_cache_served_is_not_stored_and_the_store_stays_loadable(tmp_path: Path) -> None:
    cache, store = tmp_path / "xla", tmp_path / "store"
    seeded = _run(tmp_path / "seed-store", cache, first="jit")  # fills jax's cache with the program
    served = _run(store, cache, first="jit")  # the store's compile is a hit in jax's cache
    assert served["status"] == "miss" and served["saved"] is False, served
    assert any("persistent XLA cache" in w for w in served["warnings"]), served  # type: ignore[attr-defined]
    # A new process without jax's cache: nothing kernel-less was stored, so a clean compile,
    # which the store keeps and the next process loads and runs.
    fresh = _run(store, None)
    assert fresh["status"] == "miss" and fresh["saved"] is True, fresh
    again = _run(store, None)
    assert again["status"] == "hit" and again["sum"] == fresh["sum"] == seeded["sum"], again
