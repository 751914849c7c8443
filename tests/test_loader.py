"""The safetensors loader on its own: dtypes, stacking, shardings and index problems."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.models.layers import linear, stack_blocks
from flux2klein_cli.core.weights.loader import KeyPlan, aligned_empty, copy_into, load_module, plan_from_names
from flux2klein_cli.core.weights.safetensors_io import SafetensorsCheckpoint
from tests.fixtures.reference import lazy

# torch and diffusers on first use: the module collects on a base install (no torch).
torch = lazy("torch")
st_torch = lazy("safetensors.torch")


class Block(nnx.Module):
    def __init__(self, dtype, rngs: nnx.Rngs):
        self.proj = linear(3, 5, dtype=dtype, rngs=rngs)


class Tiny(nnx.Module):
    def __init__(self, dtype, rngs: nnx.Rngs):
        self.embed = linear(4, 3, dtype=dtype, rngs=rngs)
        self.blocks = stack_blocks(lambda r: Block(dtype, r), 2, rngs)


def plan(model: Tiny) -> KeyPlan:
    return KeyPlan(plan_from_names(nnx.split(model)[1], {"blocks": 2}))


@pytest.fixture
def bf16_checkpoint(tmp_path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(3, 4, dtype=torch.bfloat16),
        "blocks.0.proj.weight": torch.randn(5, 3, dtype=torch.bfloat16),
        "blocks.1.proj.weight": torch.randn(5, 3, dtype=torch.bfloat16),
    }
    # Two shards and an index, as save_pretrained writes them.
    st_torch.save_file({"embed.weight": tensors["embed.weight"]}, tmp_path / "model-00001-of-00002.safetensors")
    blocks = {k: v for k, v in tensors.items() if k.startswith("blocks")}
    st_torch.save_file(blocks, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {k: f"model-0000{1 if k == 'embed.weight' else 2}-of-00002.safetensors" for k in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def as_bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy()


def test_bf16_tensors_load_bit_exact_and_stacked(tmp_path: Path, bf16_checkpoint) -> None:
    model = load_module(lambda: Tiny(jnp.bfloat16, nnx.Rngs(0)), plan, tmp_path)
    kernel = np.asarray(model.embed.kernel[...])
    assert kernel.dtype == ml_dtypes.bfloat16
    # Same bits: bf16 on disk goes to bf16 on device without any float32 round trip or rounding.
    assert np.array_equal(kernel.view(np.int16), as_bits(bf16_checkpoint["embed.weight"].T.contiguous()))
    stacked = np.asarray(model.blocks.proj.kernel[...])
    assert stacked.shape == (2, 3, 5)
    for i in range(2):
        expected = as_bits(bf16_checkpoint[f"blocks.{i}.proj.weight"].T.contiguous())
        assert np.array_equal(stacked[i].view(np.int16), expected)


def test_fp32_on_request_is_exact_upcast(tmp_path: Path, bf16_checkpoint) -> None:
    model = load_module(lambda: Tiny(jnp.float32, nnx.Rngs(0)), plan, tmp_path)
    kernel = np.asarray(model.embed.kernel[...])
    assert kernel.dtype == np.float32
    assert np.array_equal(kernel, bf16_checkpoint["embed.weight"].float().T.numpy())


def test_parameters_are_placed_with_the_mesh_and_rule(tmp_path: Path, bf16_checkpoint) -> None:
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
    seen = []

    def rule(path, shape):
        seen.append(path)
        return PartitionSpec("fsdp") if len(shape) == 3 else PartitionSpec()

    model = load_module(lambda: Tiny(jnp.bfloat16, nnx.Rngs(0)), plan, tmp_path, mesh=mesh, sharding_rule=rule)
    sharding = model.blocks.proj.kernel[...].sharding
    assert sharding.mesh.axis_names == ("data", "fsdp") and sharding.spec == PartitionSpec("fsdp")
    assert len(seen) == 2


def test_index_naming_a_key_that_is_not_in_its_shard(tmp_path: Path, bf16_checkpoint) -> None:
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="ghost.weight"):
        SafetensorsCheckpoint.open(tmp_path)


def test_long_key_lists_are_cut_at_ten(tmp_path: Path) -> None:
    st_torch.save_file({f"extra.{i:02d}": torch.zeros(1) for i in range(15)} | {"embed.weight": torch.zeros(3, 4)},
                       tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_module(lambda: Tiny(jnp.float32, nnx.Rngs(0)), plan, tmp_path)
    message = str(err.value)
    assert "missing keys: blocks.0.proj.weight, blocks.1.proj.weight" in message
    assert "extra.09" in message and "extra.10" not in message and "(and 5 more)" in message


def _shim_transposes() -> str | None:
    """Why the CPU kernel shim's transposing copy cannot run here (None: it can, and the shim is open)."""
    from flux2klein_cli.core.devices import cpu

    if not (cpu.is_x86() and cpu.has_avx512(cpu.cpu_flags())):
        return "the CPU has no AVX-512 (the shim is built for such CPUs only)"
    from flux2klein_cli.core.models import cpu_shim

    return cpu_shim.open_shim("bf16" if "avx512_bf16" in cpu.cpu_flags() else "f32")[1]


TRANSPOSE_PATHS = ["numpy", pytest.param("shim", marks=pytest.mark.skipif(
    _shim_transposes() is not None, reason=str(_shim_transposes())))]
# float32 values whose bf16 rounding is easy to get wrong: NaN, infinities, subnormals, signed zero,
# ties (to even, both ways), and the largest values (rounding up to infinity).
F32_EDGES = np.array([np.nan, np.inf, -np.inf, 1e-40, -1e-41, -0.0, 1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, -3.39e38,
                      1 + 2**-8 + 2**-20, np.finfo(np.float32).tiny], np.float32)


@pytest.mark.parametrize("path", TRANSPOSE_PATHS)
@pytest.mark.parametrize("shape", [(600, 300), (37, 19), (8, 64), (16, 16), (4100, 17), (3, 700)])
@pytest.mark.parametrize("types", [("bf16", "bf16"), ("f32", "bf16"), ("f32", "f32"), ("bf16", "f32")])
def test_transposing_copies_are_exact(shape, types, path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed transpose (and its fallbacks for odd sizes and slices), and the kernel shim's
    transposing copy where this CPU opens the shim, equal numpy's, bit for bit."""
    from flux2klein_cli.core.models import cpu_shim

    calls = []
    if path == "numpy":
        monkeypatch.setattr(cpu_shim, "transposer", lambda: None)
    else:
        native = cpu_shim.transposer()
        monkeypatch.setattr(cpu_shim, "transposer", lambda: calls.append(1) or native)
    names = {"bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32)}
    source, target = names[types[0]], names[types[1]]
    rng = np.random.default_rng(1)
    stored = (rng.integers(0, 2**16, size=shape, dtype=np.uint16).view(source) if source.itemsize == 2
              else rng.standard_normal(shape).astype(np.float32))  # bf16 from random bits: NaNs too
    if source.itemsize == 4:
        stored.flat[: F32_EDGES.size] = F32_EDGES[: stored.size]
    for view in (stored.T, stored.T[1:-2, 3:]):
        out = aligned_empty(view.shape, target)
        copy_into(out, view)
        assert np.array_equal(out.view(np.uint8), np.ascontiguousarray(view.astype(target)).view(np.uint8))
    # The shim moves float32 -> bf16 and same-dtype copies; bf16 -> float32 stays numpy's.
    assert bool(calls) == (path == "shim" and types != ("bf16", "f32"))


# The instructions each shim build needs of the CPU that calls its transposing copy.
BUILD_NEEDS = {"bf16": {"avx512f", "avx512bw", "avx512_bf16"}, "f32": {"avx512f", "avx512bw", "avx512dq"},
               "avx2": {"avx2", "fma"}}


def _build_unrunnable(build: str) -> str | None:
    from flux2klein_cli.core.devices import cpu
    from flux2klein_cli.core.models import cpu_shim

    if not cpu.is_x86() or not BUILD_NEEDS[build] <= set(cpu.cpu_flags()):
        return f"the CPU lacks {sorted(BUILD_NEEDS[build])}"
    return "no C++ compiler" if cpu_shim.compiler() is None else None


@pytest.mark.slow  # builds each shim where it is not built yet (about a minute each)
@pytest.mark.parametrize("build", [pytest.param(build, marks=pytest.mark.skipif(
    _build_unrunnable(build) is not None, reason=str(_build_unrunnable(build)))) for build in BUILD_NEEDS])
def test_each_shim_builds_transposing_copy_is_exact(build: str) -> None:
    """flux2klein_transpose_copy of every shim build (the AVX-512 ones transpose 16 x 16 blocks of 32-bit
    values in one go, AVX2's in four 8 x 8 ones; 16-bit blocks in AVX2 registers in all three), called
    directly: whole blocks, edges of every size, rows off the strips of columns, strided rows on both
    sides, and float32 -> bf16 with the values whose rounding is easy to get wrong. Nothing past each row
    of the destination is written."""
    import ctypes

    from flux2klein_cli.core.models import cpu_shim

    shim = cpu_shim.shim_path(build)
    assert cpu_shim.build_shim(shim, build) is None
    copy = ctypes.CDLL(str(shim)).flux2klein_transpose_copy
    copy.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                     ctypes.c_int64, ctypes.c_int]
    rng = np.random.default_rng(3)
    kinds = {0: (np.float32, np.uint16), 1: (np.uint16, np.uint16), 2: (np.uint32, np.uint32)}
    for kind, (source, target) in kinds.items():
        for rows, cols in [(16, 16), (48, 80), (37, 19), (600, 300), (4100, 17), (33, 520), (9, 700)]:
            if source is np.float32:
                stored = rng.standard_normal((rows, cols + 5)).astype(np.float32)
                stored.flat[: F32_EDGES.size] = F32_EDGES
                expected = stored[:, :cols].T.astype(ml_dtypes.bfloat16).view(np.uint16)
            else:
                stored = rng.integers(0, np.iinfo(source).max, size=(rows, cols + 5), dtype=source)
                expected = stored[:, :cols].T
            dest = np.full((cols, rows + 3), 7, target)
            assert copy(stored.ctypes.data, rows, cols, cols + 5, dest.ctypes.data, rows + 3, kind) == 0
            assert np.array_equal(dest[:, :rows], expected), (kind, rows, cols)
            assert (dest[:, rows:] == 7).all()
    assert copy(stored.ctypes.data, 4, 4, 4, dest.ctypes.data, 4, 3) == 1


def test_a_large_buffer_is_resident_when_made_and_jax_adopts_it_without_a_copy() -> None:
    """aligned_empty's large buffers come with their pages mapped (MAP_POPULATE on Linux): writing one
    takes next to no page faults, where a buffer from malloc takes one per page or block of pages.
    Both sizes are aligned for JAX, which holds the parameter in the same memory."""
    import resource
    import sys

    def faults_while_filling(array: np.ndarray) -> int:
        before = resource.getrusage(resource.RUSAGE_THREAD if sys.platform == "linux" else resource.RUSAGE_SELF)
        array.fill(1)
        after = resource.getrusage(resource.RUSAGE_THREAD if sys.platform == "linux" else resource.RUSAGE_SELF)
        return after.ru_minflt - before.ru_minflt

    faults_while_filling(np.empty((3, 5), np.float32))  # the fill's own code and stack pages, faulted here
    for shape in ((1024, 1024), (3, 5)):
        out = aligned_empty(shape, np.dtype(np.float32))
        assert out.shape == shape and out.flags.c_contiguous and out.flags.writeable and out.ctypes.data % 64 == 0
        faults = faults_while_filling(out)
        if sys.platform == "linux" and out.nbytes >= (1 << 20):
            # an unpopulated 4 MiB mapping takes 1,024 (one per 4 KiB page); a few stray faults
            # (the allocator, a timer's stack) are not the buffer's
            assert faults <= 16, f"{faults} page faults writing a populated {out.nbytes >> 20} MiB buffer"
        device = jax.make_array_from_callback(shape, jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]),
                                              lambda index, h=out: h)
        assert device.addressable_data(0).unsafe_buffer_pointer() == out.ctypes.data
        np.testing.assert_array_equal(np.asarray(device), np.ones(shape, np.float32))


def _tracked_reads(sizes: list[int], log: dict[str, int], lock) -> list[tuple[int, object]]:
    """Reads that note the bytes held by reads started and not yet taken, and the most at once."""
    import time

    def read(i: int, size: int) -> int:
        with lock:
            log["running"] += 1
            log["bytes"] += size
            log["most_running"] = max(log["most_running"], log["running"])
            log["most_bytes"] = max(log["most_bytes"], log["bytes"])
        time.sleep(0.01)
        with lock:
            log["running"] -= 1
            log["bytes"] -= size
        return i

    return [(size, lambda i=i, size=size: read(i, size)) for i, size in enumerate(sizes)]


def test_reads_ahead_come_back_in_order_within_the_budget() -> None:
    import threading

    from flux2klein_cli.core.weights import loader

    lock, log = threading.Lock(), dict.fromkeys(("running", "most_running", "bytes", "most_bytes"), 0)
    sizes = [10, 40, 10, 10, 30, 10, 10, 10]
    got = list(loader._read_ahead(_tracked_reads(sizes, log, lock), budget=50))
    assert got == list(range(len(sizes)))
    assert log["most_running"] >= 2  # it did read ahead
    assert log["most_bytes"] <= 50


def test_no_budget_reads_one_at_a_time() -> None:
    import threading

    from flux2klein_cli.core.weights import loader

    lock, log = threading.Lock(), dict.fromkeys(("running", "most_running", "bytes", "most_bytes"), 0)
    got = list(loader._read_ahead(_tracked_reads([10] * 6, log, lock), budget=0))
    assert got == list(range(6)) and log["most_running"] == 1


def test_a_read_that_fails_raises_in_the_caller() -> None:
    from flux2klein_cli.core.weights import loader

    def bad() -> int:
        raise CheckpointError("truncated")

    reads = loader._read_ahead([(1, lambda: 0), (1, bad), (1, lambda: 2)], budget=10)
    assert next(reads) == 0
    with pytest.raises(CheckpointError, match="truncated"):
        next(reads)


def test_only_an_array_whole_on_this_process_is_read_ahead() -> None:
    """A process of a multi-host run sees one device yet holds half of an fsdp-split array."""
    from dataclasses import dataclass

    from flux2klein_cli.core.weights.loader import held_whole_here

    @dataclass
    class Placement:  # the two things the choice reads from a jax Sharding
        addressable_devices: set[int]
        split: int

        def shard_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
            return (shape[0] // self.split, *shape[1:])

    assert held_whole_here(Placement({0}, 1), (96, 64))
    assert not held_whole_here(Placement({0}, 2), (96, 64))  # the other half is on process 1
    assert not held_whole_here(Placement({0, 1}, 1), (96, 64))  # replicas: each device reads its own


def test_a_one_device_mesh_holds_every_parameter_whole() -> None:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from flux2klein_cli.core.weights.loader import held_whole_here

    mesh = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
    assert held_whole_here(NamedSharding(mesh, PartitionSpec("fsdp", None)), (96, 64))
