"""`bench --tpu v6-4` on a host without that slice: the run compiled for it through the
executable store, with memory, the fits verdict and XLA's cost per program; exit 0."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="compiling for a TPU needs libtpu")


def bench(store: Path) -> dict:
    env = dict(os.environ, FLUX2KLEIN_XLA_CACHE="off")
    done = subprocess.run([sys.executable, "-m", "flux2klein_cli", "bench", "--model", "tiny", "--tpu", "v6-4", "--bs",
                           "8", "--height", "64", "--width", "64", "--steps", "2", "--compile-cache", str(store),
                           "--json"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_bench_for_a_slice_this_host_lacks_reports_compile_memory_and_cost(tmp_path: Path) -> None:
    first = bench(tmp_path / "store")
    assert first["timed"] is False and "need the v6e-4 slice" in first["note"]
    assert first["slice"]["chips"] == 4 and first["batch"] == 8
    names = [p["name"] for p in first["programs"]]
    assert set(names) == {"text_encoder", "noise", "denoise", "vae_decode"}
    for p in first["programs"]:
        assert p["status"] == "miss" and p["compile_s"] > 0, p
        assert p["cost"]["flops"] > 0 and p["cost"]["bytes_accessed"] > 0, p
        assert 0 < p["peak_bytes_per_device"] <= p["needed_bytes_per_device"], p
    assert first["verdict"]["fits"] and first["peak_bytes_per_device"] == first["verdict"]["needed_bytes"]
    estimate = first["estimate"]
    assert estimate is None or ("estimate" in estimate["kind"] and estimate["per_image_s"] > 0)

    # Through the store, as `compile` does: a second bench loads every program, costs included.
    second = bench(tmp_path / "store")
    assert [p["status"] for p in second["programs"]] == ["hit"] * len(names) and second["compile_s"] == 0
    assert [p["cost"] for p in second["programs"]] == [p["cost"] for p in first["programs"]]
