"""The TPU attention path (Pallas splash attention) checked on CPU in interpret mode: padding,
queries shorter than keys, small head dims, bf16, and the shard_map under a mesh (in a
subprocess with 4 virtual devices, as the device count is fixed when JAX starts)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flux2klein_cli.core.models import tpu_attention, trace
from flux2klein_cli.core.models.layers import _blocked_attention, dot_product_attention

ROOT = Path(__file__).resolve().parents[1]
# Interpret mode runs the kernel op by op: shapes stay small (a few blocks) to keep this file fast.
SHAPES = {
    "padded": (2, 200, 200, 3, 128),  # (B, Sq, Sk, H, Dh): neither length a multiple of 128
    "fewer-queries": (2, 130, 300, 2, 128),  # reference queries against all keys
    "small-head-dim": (1, 70, 150, 2, 32),  # the tiny test models' head dim
    "exact-blocks": (1, 256, 128, 2, 64),  # no padding: no segment ids
}


def qkv(b: int, sq: int, sk: int, h: int, d: int, dtype: jnp.dtype) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(sq * sk + d), 3)
    return tuple(jax.random.normal(key, (b, s, h, d), jnp.float32).astype(dtype)
                 for key, s in zip(keys, (sq, sk, sk), strict=True))


def reference(q: jax.Array, k: jax.Array, v: jax.Array) -> np.ndarray:
    """XLA's attention in float32 on the same (rounded) inputs."""
    return np.asarray(jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in (q, k, v))))


@contextlib.contextmanager
def kernel_everywhere() -> Iterator[None]:
    """The kernel path on any backend, in interpret mode, so the TPU path can be checked on CPU."""
    with trace.tracing(dataclasses.replace(trace.current(), attention="splash-interpret")):
        yield


def kernel_taken() -> bool:
    return trace.current().attention.startswith("splash")


def kernel_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> np.ndarray:
    with kernel_everywhere():
        out = jax.jit(dot_product_attention)(q, k, v)
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
# float32: a few dozen units in the last place, at LLVM's -O0 (the suite's level; its rounding
# differs from the default's) and at the default; a wrong kernel is off by far more.
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 4e-6), (jnp.bfloat16, 2e-2)], ids=["f32", "bf16"])
def test_kernel_equals_xla_attention(shape: tuple[int, ...], dtype: jnp.dtype, tolerance: float) -> None:
    q, k, v = qkv(*shape, dtype)
    out, expected = kernel_attention(q, k, v), reference(q, k, v)
    assert out.shape == expected.shape == q.shape
    assert np.abs(out - expected).max() <= tolerance * np.abs(expected).max()


@pytest.mark.slow
def test_kernel_path_is_taken_only_when_asked_off_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    splash = tpu_attention.splash_attention
    monkeypatch.setattr(tpu_attention, "splash_attention", lambda q, k, v: calls.append(q.shape) or splash(q, k, v))
    q, k, v = qkv(1, 40, 40, 2, 16, jnp.float32)
    assert jax.default_backend() == "cpu" and not kernel_taken()
    # Off TPU, by default: the CPU's form (the kernel plugin's where one loaded), never the TPU kernel;
    # with XLA's own CPU forms, exactly the query-blocked one, as before the kernel existed.
    jax.block_until_ready(dot_product_attention(q, k, v))
    with trace.tracing(dataclasses.replace(trace.current(), kernels=None)):
        np.testing.assert_array_equal(np.asarray(dot_product_attention(q, k, v)),
                                      np.asarray(_blocked_attention(q, k, v)))
    assert calls == []
    with kernel_everywhere():
        jax.jit(dot_product_attention)(q, k, v)
    assert calls == [q.shape] and not kernel_taken()


@pytest.mark.parametrize("length, block", [(128, 128), (200, 256), (512, 512), (600, 384), (4592, 512), (2304, 512)])
def test_block_size_pads_less_than_a_lane_per_block(length: int, block: int) -> None:
    assert tpu_attention.block_size(length) == block


# (data, fsdp, tensor, context) meshes over 4 devices, and a batch / heads / lengths that each splits;
# batch 1 leaves data and fsdp idle: the queries are split over them too (the sequence form).
MESHES = [(1, 2, 1, 2), (2, 1, 2, 1), (1, 4, 1, 1), (1, 4, 1, 1), (2, 2, 1, 1)]
BATCHES = [4, 4, 4, 1, 1]


def mesh_worker() -> None:
    """In the subprocess: the kernel under each mesh (shard_map) against XLA's attention."""
    from jax.sharding import Mesh

    for shape, batch in zip(MESHES, BATCHES, strict=True):
        mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "fsdp", "tensor", "context"))
        q, k, v = qkv(batch, 200, 300, 2, 32, jnp.float32)
        with jax.set_mesh(mesh):
            with kernel_everywhere():
                jaxpr = str(jax.make_jaxpr(dot_product_attention)(q, k, v))
                out = np.asarray(jax.jit(dot_product_attention)(q, k, v))
        error = float(np.abs(out - reference(q, k, v)).max())
        print(json.dumps(dict(mesh=shape, error=error, shard_map="shard_map" in jaxpr,
                              split_queries=bool(re.search(r"\('context', '(data|fsdp)'", jaxpr)))), flush=True)


@pytest.mark.slow
def test_kernel_under_a_mesh_runs_in_shard_map() -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "tests.test_tpu_attention"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [tuple(r["mesh"]) for r in rows] == MESHES
    for row, batch in zip(rows, BATCHES, strict=True):
        assert row["shard_map"] and row["error"] <= 1e-5, row
        assert row["split_queries"] == (batch == 1), row


if __name__ == "__main__":
    mesh_worker()
