"""Safetensors -> Flax NNX: strict key and shape checks, direct dtype conversion, sharded placement.

A model says where each of its parameters comes from with a *key plan*: for every
NNX parameter path, the checkpoint key (or one key per layer for scanned, stacked
blocks) and the layout change from torch to JAX. The model is built abstractly
(`nnx.eval_shape`, no initialisation, no memory); each parameter is then created with
`jax.make_array_from_callback`, so every device reads only its own slice of the
memory-mapped file and the whole model never sits twice in host memory.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flux2klein_cli.core.devices.mesh import default_mesh
from flux2klein_cli.core.devices.sharding import replicated_rule
from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.models import cpu_shim
from flux2klein_cli.core.weights.safetensors_io import SafetensorsCheckpoint, _first

Path_ = tuple[str, ...]
M = TypeVar("M", bound=nnx.Module)
T = TypeVar("T")
# "linear": torch (out, in) -> (in, out); "conv": torch OIHW -> HWIO; "none": as stored.
Layout = Literal["none", "linear", "conv"]


@dataclass(frozen=True)
class TensorSource:
    """Where one NNX parameter comes from: one key, or one key per layer (stacked on axis 0)."""

    keys: tuple[str, ...]
    layout: Layout = "none"
    stacked: bool = False


@dataclass(frozen=True)
class KeyPlan:
    """Every NNX parameter's source, plus the checkpoint keys that are deliberately not read."""

    sources: Mapping[Path_, TensorSource]
    ignore: Callable[[str], bool] = lambda key: False


def single(key: str, layout: Layout = "none") -> TensorSource:
    return TensorSource((key,), layout)


def stacked(keys: Iterable[str], layout: Layout = "none") -> TensorSource:
    return TensorSource(tuple(keys), layout, stacked=True)


def _to_jax_layout(array: np.ndarray, layout: Layout) -> np.ndarray:
    if layout == "linear":
        return array.T
    if layout == "conv":
        return array.transpose(2, 3, 1, 0)
    return array


def _layout_shape(shape: tuple[int, ...], layout: Layout) -> tuple[int, ...]:
    if layout == "linear" and len(shape) == 2:
        return (shape[1], shape[0])
    if layout == "conv" and len(shape) == 4:
        return (shape[2], shape[3], shape[1], shape[0])
    return shape


ShardingRule = Callable[[Path_, tuple[int, ...]], PartitionSpec]



def raise_on_mismatch(
    where: Path | str, *, missing: Iterable[str] = (), unexpected: Iterable[str] = (), wrong: Iterable[str] = ()
) -> None:
    """One CheckpointError naming (the first 10 of) each kind of mismatch, if there is any."""
    problems = [f"{label}: {_first(set(names))}" for label, names in
                (("missing keys", list(missing)), ("unexpected keys", list(unexpected))) if names]
    wrong = list(wrong)
    if wrong:
        more = f" (and {len(wrong) - 10} more)" if len(wrong) > 10 else ""
        problems.append("wrongly shaped keys: " + "; ".join(wrong[:10]) + more)
    if problems:
        raise CheckpointError(f"{where}: checkpoint does not match the model config; " + "; ".join(problems))


def check_plan(
    checkpoint: SafetensorsCheckpoint, plan: KeyPlan, abstract: Mapping[Path_, jax.ShapeDtypeStruct]
) -> None:
    """Raise a CheckpointError naming missing, unexpected and wrongly shaped keys."""
    if set(abstract) != set(plan.sources):
        raise AssertionError(  # a bug in a model's key plan, not in the checkpoint
            f"key plan does not cover the model: {_first(set(abstract) ^ set(plan.sources))}"
        )
    wanted = {key for source in plan.sources.values() for key in source.keys}
    have = checkpoint.keys()
    missing = wanted - have
    unexpected = {k for k in have - wanted if not plan.ignore(k)}
    where = checkpoint.directory
    raise_on_mismatch(where, missing=missing, unexpected=unexpected)

    wrong = []
    for path, source in plan.sources.items():
        target = tuple(abstract[path].shape)
        per_key = target[1:] if source.stacked else target
        if source.stacked and target[0] != len(source.keys):
            raise AssertionError(f"{'.'.join(path)}: {target[0]} layers but {len(source.keys)} keys")
        for key in source.keys:
            got = _layout_shape(checkpoint.tensors[key].shape, source.layout)
            if got != per_key:
                stored = checkpoint.tensors[key].shape
                wrong.append(f"{key} in {checkpoint.describe(key)} is {stored}, model expects {per_key}")
    raise_on_mismatch(where, wrong=wrong)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux's
_POPULATED_MIN_BYTES = 1 << 20  # smaller ones (norms, biases: many and small) come from malloc


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data is `align`-byte aligned. JAX's CPU client
    adopts such a buffer as the device array without copying it (a 16-byte aligned one from plain
    np.empty is copied), so a parameter is materialised exactly once.

    From _POPULATED_MIN_BYTES up (where Linux offers it) the buffer is its own mapping, its pages
    made resident when it is mapped (MAP_POPULATE, page-aligned): the kernel fills them in one call,
    where a plain buffer takes a page fault per page as the copy first writes it, and those faults
    were the slow, erratic part of loading on a VM whose fresh memory is cold (docs/benchmarks.md)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes >= _POPULATED_MIN_BYTES and _POPULATE:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        return np.frombuffer(region, np.uint8, nbytes).view(dtype).reshape(shape)
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


# A transposing copy of a big 2-D tensor packs first, then transposes 16-byte elements:
# numpy's strided copy costs about the same per element whatever its size, so moving
# 16 bytes (8 bf16 values) per element instead of 2 is what makes it fast. Other strided
# copies walk the source in tiles of (rows x columns) of its stored order that stay in cache.
_TILE_ROWS, _TILE_COLS = 64, 4096
_PACKED = np.dtype((np.void, 16))
_BAND, _SPAN = 32, 4096  # packed columns x destination rows per step: the scratch is <= 2 MiB
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_PARALLEL_MIN_ELEMENTS = 1 << 20
_pool: ThreadPoolExecutor | None = None
_scratch = threading.local()


def _workers() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="flux2klein-copy")
    return _pool


def _packable(dest: np.ndarray, src: np.ndarray) -> bool:
    """dest (C-ordered rows) = src, a transposed view of row-contiguous storage, big enough to pack."""
    return (src.ndim == 2 and dest.ndim == 2 and dest.itemsize in _BITS and src.strides[0] == src.itemsize
            and dest.strides[1] == dest.itemsize and dest.shape[1] >= 16 // dest.itemsize and dest.shape[0] >= 16)


def _scratch_for(shape: tuple[int, ...], dtype: np.dtype, slot: str = "buffer") -> np.ndarray:
    """A per-thread buffer reused across copies (fresh memory is slow to touch on this project's VMs).
    Each `slot` is its own buffer, so buffers in use at the same time never overlap."""
    need = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buffer = getattr(_scratch, slot, None)
    if buffer is None or buffer.nbytes < need:
        buffer = np.empty(need, np.uint8)
        setattr(_scratch, slot, buffer)
    return buffer[:need].view(dtype).reshape(shape)


def _transpose_packed(dest: np.ndarray, src: np.ndarray) -> None:
    """dest = src for src = stored.T, stored (out, in) with contiguous rows, dest (in, out).

    For each band of k = 16 / itemsize stored rows, the rows are interleaved into a scratch
    (b, span, k) array (contiguous reads, converting the dtype if asked); a scratch row of k
    values is then one 16-byte element of the destination's row, and the transposing copy moves
    those: k times fewer elements than transposing the values one by one (about 2x faster)."""
    k = 16 // dest.itemsize
    stored = src.T
    rows, cols = dest.shape
    packed_cols = cols // k
    wide = dest[:, : packed_cols * k].view(_PACKED)  # (rows, packed_cols), one element per k values
    span = min(_SPAN, rows)
    scratch = _scratch_for((_BAND, span, k), dest.dtype)
    for j0 in range(0, packed_cols, _BAND):
        j1 = min(j0 + _BAND, packed_cols)
        for i0 in range(0, rows, span):
            i1 = min(i0 + span, rows)
            block = scratch[: j1 - j0, : i1 - i0]
            for t in range(k):
                np.copyto(block[:, :, t], stored[j0 * k + t : j1 * k : k, i0:i1], casting="unsafe")
            np.copyto(wide[i0:i1, j0:j1], block.view(_PACKED)[..., 0].T)
    if cols % k:
        np.copyto(dest[:, packed_cols * k :], stored[packed_cols * k :].T, casting="unsafe")


# (source dtype, destination dtype) -> the kind of cpu_kernels.cc's flux2klein_transpose_copy.
_NATIVE_KINDS = {("float32", "bfloat16"): 0, ("uint16", "uint16"): 1, ("uint32", "uint32"): 2}


def _native_transpose(dest: np.ndarray, src: np.ndarray) -> bool:
    """dest = src (a transposed view of row-contiguous storage) through the CPU kernel shim's
    transposing copy, 5-10x numpy's, when this process opened the shim and moves these dtypes
    (cpu_shim.transposer); False when it did nothing."""
    kind = _NATIVE_KINDS.get((src.dtype.name, dest.dtype.name))
    if (kind is None or src.ndim != 2 or src.strides[0] != src.itemsize or dest.strides[1] != dest.itemsize
            or src.strides[1] % src.itemsize or dest.strides[0] % dest.itemsize):
        return False
    copy = cpu_shim.transposer()
    if copy is None:
        return False
    rows, cols = dest.shape  # the stored rows are dest's columns
    return copy(src.ctypes.data, cols, rows, src.strides[1] // src.itemsize, dest.ctypes.data,
                dest.strides[0] // dest.itemsize, kind) == 0


def _copy_tiles(dest: np.ndarray, src: np.ndarray) -> None:
    if src.ndim != 2 or src.flags.c_contiguous:
        np.copyto(dest, src, casting="unsafe")
        return
    if _native_transpose(dest, src):
        return
    if _packable(dest, src):
        _transpose_packed(dest, src)
        return
    rows, cols = dest.shape  # src (in, out) is a transposed view of the stored (out, in)
    for j in range(0, cols, _TILE_ROWS):
        for i in range(0, rows, _TILE_COLS):
            np.copyto(dest[i : i + _TILE_COLS, j : j + _TILE_ROWS], src[i : i + _TILE_COLS, j : j + _TILE_ROWS],
                      casting="unsafe")


def copy_into(dest: np.ndarray, src: np.ndarray) -> None:
    """dest[...] = src, converting the dtype if they differ; fast for transposed views.

    numpy copies a transposed 2-D view element by element in destination order, striding
    through the source; packing 16 bytes per element (see `_transpose_packed`) makes that about
    4x faster than a plain copy and 2x faster than cache tiles. Same-dtype copies move raw bits
    (uint views), so bf16 needs no ml_dtypes loop. numpy releases the GIL while copying, so
    bands of a large tensor are copied on all cores."""
    if dest.dtype == src.dtype and dest.dtype.itemsize in _BITS:
        bits = _BITS[dest.dtype.itemsize]
        dest, src = dest.view(bits), src.view(bits)
    workers = os.cpu_count() or 1
    if workers == 1 or src.size < _PARALLEL_MIN_ELEMENTS or dest.ndim == 0 or dest.shape[0] < workers:
        _copy_tiles(dest, src)
        return
    step = -(-dest.shape[0] // workers)
    futures = [_workers().submit(_copy_tiles, dest[a : a + step], src[a : a + step])
               for a in range(0, dest.shape[0], step)]
    for future in futures:
        future.result()


def _sliced_shape(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


class Deltas(Protocol):
    """Changes merged into weights as they are read (core/lora/merge.py: LoRA deltas)."""

    def check(self, shapes: Mapping[str, tuple[int, ...]]) -> None: ...

    def changes(self, key: str) -> bool: ...

    def add(self, key: str, block: np.ndarray, rows: slice, cols: slice, scratch: np.ndarray) -> None: ...


_MERGE_BAND_BYTES = 4 << 20  # float32 bytes of one band: a few of them per thread stay cached


def _blas_threads_setter() -> Callable[[int], int] | None:
    """numpy's OpenBLAS `openblas_set_num_threads_local` (per calling thread), when it has one."""
    global _blas_setter
    if _blas_setter is None:
        import ctypes
        import glob

        _blas_setter = False
        libs = Path(np.__file__).parent.parent / "numpy.libs"
        for path in sorted(glob.glob(str(libs / "*openblas*.so*"))):
            try:
                function = ctypes.CDLL(path).openblas_set_num_threads_local
            except (OSError, AttributeError):
                continue
            function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
            _blas_setter = function
            break
    return _blas_setter or None


_blas_setter: Callable[[int], int] | bool | None = None


def _merge_bands(out: np.ndarray, stored: np.ndarray, key: str, linear: bool, rows: range, cols: slice,
                 bands: list[tuple[int, int]], deltas: Deltas) -> None:
    """For each band of stored rows: convert to float32 in a per-thread scratch, add the delta in
    place, and cast once into `out` (transposed for a linear kernel). The bands are the
    parallelism: OpenBLAS runs one thread per band worker (its own threads would spin beside
    ours and slow every band's product)."""
    setter = _blas_threads_setter()
    previous = setter(1) if setter else None
    try:
        _merge_band_list(out, stored, key, linear, rows, cols, bands, deltas)
    finally:
        if setter and previous is not None:
            setter(previous)


def _widen(block: np.ndarray, stored: np.ndarray) -> None:
    """block (float32) = stored; bf16 by moving its bits up (exact, and faster than ml_dtypes' cast)."""
    if stored.dtype.name == "bfloat16":
        np.left_shift(stored.view(np.uint16), 16, out=block.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(block, stored, casting="unsafe")


def _merge_band_list(out: np.ndarray, stored: np.ndarray, key: str, linear: bool, rows: range, cols: slice,
                     bands: list[tuple[int, int]], deltas: Deltas) -> None:
    width = len(range(*cols.indices(stored.shape[1])))
    for r0, r1 in bands:
        block = _scratch_for((r1 - r0, width), np.dtype(np.float32), "merge")
        _widen(block, stored[r0:r1, cols])
        deltas.add(key, block, slice(r0, r1), cols, _scratch_for(block.shape, np.dtype(np.float32), "term"))
        a, b = r0 - rows.start, r1 - rows.start
        # Narrow in stored order (a contiguous cast), then move raw bits into place: casting while
        # transposing made ml_dtypes convert element by element, strided (2x slower per band).
        narrow = block
        if out.dtype != block.dtype:
            narrow = _scratch_for(block.shape, out.dtype, "narrow")
            np.copyto(narrow, block, casting="unsafe")
        target = out[:, a:b] if linear else out[a:b]
        if out.dtype.itemsize in _BITS:
            bits = _BITS[out.dtype.itemsize]
            target, narrow = target.view(bits), narrow.view(bits)
        _copy_tiles(target, narrow.T if linear else narrow)


def _merge_key(out: np.ndarray, stored: np.ndarray, key: str, layout: Layout, index: tuple[slice, ...],
               deltas: Deltas) -> None:
    """out = stored[index] + delta for a 2-D weight (stored in torch layout), in bands of stored
    rows over all cores: no temporary of the slice's size is ever allocated."""
    linear = layout == "linear"
    index = tuple(index) + (slice(None),) * (2 - len(index))
    row_index, col_index = (index[1], index[0]) if linear else index  # JAX (in, out) = torch (out, in).T
    rows = range(*row_index.indices(stored.shape[0]))
    cols = slice(*col_index.indices(stored.shape[1]))
    if rows.step != 1 or cols.step != 1:
        raise AssertionError(f"{key}: strided device slice {index}")
    width = max(len(range(*cols.indices(stored.shape[1]))), 1)
    band = max(8, _MERGE_BAND_BYTES // (4 * width) // 8 * 8)  # a multiple of 8: whole packed bf16 columns
    bands = [(r, min(r + band, rows.stop)) for r in range(rows.start, rows.stop, band)]
    workers = min(os.cpu_count() or 1, len(bands))
    if workers <= 1:
        _merge_bands(out, stored, key, linear, rows, cols, bands, deltas)
        return
    futures = [_workers().submit(_merge_bands, out, stored, key, linear, rows, cols, bands[w::workers], deltas)
               for w in range(workers)]
    for future in futures:
        future.result()


def _copy_key(out: np.ndarray, checkpoint: SafetensorsCheckpoint, key: str, layout: Layout,
              index: tuple[slice, ...], deltas: Deltas | None) -> None:
    if deltas is not None and deltas.changes(key):
        _merge_key(out, checkpoint.view(key), key, layout, index, deltas)
    else:
        copy_into(out, _to_jax_layout(checkpoint.view(key), layout)[index])
    checkpoint.release(key)


def read_into(
    out: np.ndarray, checkpoint: SafetensorsCheckpoint, source: TensorSource, index: tuple[slice, ...] = (),
    deltas: Deltas | None = None,
) -> None:
    """Write the slice `index` of one parameter, in `out`'s dtype and JAX layout, into `out`: one
    conversion per value, straight from the mapped file (stacked layers go into their slots, not
    stacked afterwards); each tensor's pages are unmapped once copied. `deltas` (LoRA) are added to
    their keys' slices on the way."""
    if not source.stacked:
        _copy_key(out, checkpoint, source.keys[0], source.layout, tuple(index), deltas)
        return
    layers = range(len(source.keys))[index[0]] if index else range(len(source.keys))
    rest = tuple(index[1:]) if index else ()
    for slot, layer in enumerate(layers):
        _copy_key(out[slot], checkpoint, source.keys[layer], source.layout, rest, deltas)


def _read_slice(
    checkpoint: SafetensorsCheckpoint,
    source: TensorSource,
    index: tuple[slice, ...],
    dtype: np.dtype,
    shape: tuple[int, ...],
    deltas: Deltas | None = None,
) -> np.ndarray:
    """The host bytes of one device's slice, in one aligned buffer that the device adopts."""
    out = aligned_empty(_sliced_shape(shape, index), dtype)
    read_into(out, checkpoint, source, index, deltas)
    return out


def weight_shapes(checkpoint: SafetensorsCheckpoint, plan: KeyPlan) -> dict[str, tuple[int, ...]]:
    """Each planned checkpoint key's stored (torch layout) shape: what LoRA deltas must match. Keys
    the plan skips on purpose (the text encoder's layers past its last feature layer) count too: a
    delta there is a real weight's, it just changes nothing the model computes."""
    planned = {key for source in plan.sources.values() for key in source.keys}
    return {key: tuple(info.shape) for key, info in checkpoint.tensors.items() if key in planned or plan.ignore(key)}


def unique_shards(sharding: jax.sharding.Sharding, shape: tuple[int, ...]
                  ) -> list[tuple[tuple[slice, ...], list[jax.Device]]]:
    """Each distinct slice of an array that `sharding` places on this host's devices, with the
    devices that hold it: devices holding the same slice (replicas) share one read."""
    groups: dict[tuple[tuple[int, int], ...], tuple[tuple[slice, ...], list[jax.Device]]] = {}
    for device, index in sharding.addressable_devices_indices_map(tuple(shape)).items():
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        groups.setdefault(bounds, (tuple(index), []))[1].append(device)
    return list(groups.values())


def held_whole_here(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
    """Whether this process's one device holds all of the array: a process of a multi-host run
    also sees one device, yet holds only its slice."""
    return len(sharding.addressable_devices) == 1 and tuple(sharding.shard_shape(shape)) == tuple(shape)


def iter_arrays(
    checkpoint: SafetensorsCheckpoint,
    plan: KeyPlan,
    abstract_state: nnx.State,
    mesh: Mesh | None = None,
    sharding_rule: ShardingRule = replicated_rule,
    deltas: Deltas | None = None,
    ahead_bytes: int = 0,
) -> Iterator[tuple[Path_, jax.Array]]:
    """Each parameter in turn, read from the checkpoint into its abstract dtype and sharding.
    With `ahead_bytes` 0, one parameter at a time: a caller that writes and drops them (convert)
    holds one at most. Otherwise the next parameters that sit whole on one device (a CPU run) are
    read on reader threads meanwhile, up to that many bytes: many small tensors (the text
    encoder's) are copied on every core, not one after another."""
    mesh = mesh or default_mesh()
    flat = dict(nnx.to_flat_state(abstract_state))
    abstract = {path: var.get_value() for path, var in flat.items()}
    check_plan(checkpoint, plan, abstract)
    if deltas is not None:
        deltas.check(weight_shapes(checkpoint, plan))
    placed = []  # (path, shape, dtype, sharding)
    for path in flat:
        shape = tuple(abstract[path].shape)
        placed.append((path, shape, np.dtype(abstract[path].dtype), NamedSharding(mesh, sharding_rule(path, shape))))
    whole = {path for path, shape, _, sharding in placed if held_whole_here(sharding, shape)}
    reads = _read_ahead(((math.prod(shape) * dtype.itemsize,
                          lambda s=plan.sources[path], d=dtype, sh=shape: _read_slice(checkpoint, s, (), d, sh, deltas))
                         for path, shape, dtype, _ in placed if path in whole), ahead_bytes)
    for path, shape, dtype, sharding in placed:
        if path in whole:
            host = next(reads)
            yield path, jax.make_array_from_callback(shape, sharding, lambda index, h=host: h)
            continue
        yield path, jax.make_array_from_callback(
            shape, sharding,
            lambda index, s=plan.sources[path], d=dtype, sh=shape: _read_slice(checkpoint, s, index, d, sh, deltas)
        )


_READ_AHEAD_BYTES = 256 << 20  # what a load reads ahead (iter_arrays): a few of the largest parameters
_readers: ThreadPoolExecutor | None = None


def _read_ahead(reads: Iterable[tuple[int, Callable[[], T]]], budget: int) -> Iterator[T]:
    """Each read's result, in order; while the oldest is awaited, the next ones run on reader
    threads as long as the bytes they hold stay within `budget` (0: one read at a time)."""
    global _readers
    if _readers is None:
        _readers = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="flux2klein-read")
    pending: deque[tuple[int, Future[T]]] = deque()
    held = 0
    for size, read in reads:
        while pending and held + size > budget:
            done, future = pending.popleft()
            held -= done
            yield future.result()
        pending.append((size, _readers.submit(read)))
        held += size
    while pending:
        yield pending.popleft()[1].result()


def load_state(
    checkpoint: SafetensorsCheckpoint,
    plan: KeyPlan,
    abstract_state: nnx.State,
    mesh: Mesh | None = None,
    sharding_rule: ShardingRule = replicated_rule,
    deltas: Deltas | None = None,
) -> nnx.State:
    """Fill an abstract NNX state from the checkpoint, each leaf in its abstract dtype."""
    flat = dict(nnx.to_flat_state(abstract_state))
    arrays = dict(iter_arrays(checkpoint, plan, abstract_state, mesh, sharding_rule, deltas, _READ_AHEAD_BYTES))
    return nnx.from_flat_state([(path, var.replace(arrays[path])) for path, var in flat.items()])


def load_module(
    build: Callable[[], M] | M,
    plan_for: Callable[[M], KeyPlan],
    directory: str | Path,
    mesh: Mesh | None = None,
    sharding_rule: ShardingRule = replicated_rule,
    deltas: Deltas | None = None,
) -> M:
    """Build a module abstractly (or take `build`, an abstract module already), then load its weights
    from a component directory (with `deltas` merged into them)."""
    return load_from(SafetensorsCheckpoint.open(directory), build, plan_for, mesh, sharding_rule, deltas)


def load_from(
    checkpoint: SafetensorsCheckpoint,
    build: Callable[[], M] | M,
    plan_for: Callable[[M], KeyPlan],
    mesh: Mesh | None = None,
    sharding_rule: ShardingRule = replicated_rule,
    deltas: Deltas | None = None,
    prepare: Callable[[nnx.Module, KeyPlan], tuple[nnx.Module, KeyPlan]] = lambda model, plan: (model, plan),
) -> M:
    """load_module's work on an open checkpoint; `prepare` fits the abstract model and its plan to
    the checkpoint first (core/weights/prequantized.py: the linears a quantized file keeps)."""
    abstract = build if isinstance(build, nnx.Module) else nnx.eval_shape(build)
    model, plan = prepare(abstract, plan_for(abstract))
    graphdef, abstract_state = nnx.split(model)
    return nnx.merge(graphdef, load_state(checkpoint, plan, abstract_state, mesh, sharding_rule, deltas))


def plan_from_names(
    abstract_state: nnx.State,
    stacked_counts: Mapping[str, int] | None = None,
    *,
    prefix: str = "",
) -> dict[Path_, TensorSource]:
    """Sources for modules whose attribute paths mirror the checkpoint's key names (every model's
    plan: the transformer and VAE as diffusers names them, Qwen3 as transformers does).

    A key is `prefix` + the dotted path; `kernel` leaves come from torch's `weight` (transposed for
    Linear, OIHW->HWIO for Conv), `embedding` from `weight`; an nnx.List item is its index
    (`to_out.0`); a path starting with a name in `stacked_counts` is a scanned stack whose layer i
    comes from `<prefix><name>.<i>.<rest>`.
    """
    stacked_counts = stacked_counts or {}
    sources: dict[Path_, TensorSource] = {}
    for path, var in nnx.to_flat_state(abstract_state):
        *modules, leaf = (str(p) for p in path)
        ndim = len(var.get_value().shape)
        layout: Layout = "none"
        if leaf == "kernel":
            leaf, layout = "weight", ("conv" if ndim - (modules[0] in stacked_counts) == 4 else "linear")
        elif leaf == "embedding":
            leaf = "weight"
        if modules and modules[0] in stacked_counts:
            rest = ".".join([*modules[1:], leaf])
            keys = [f"{prefix}{modules[0]}.{i}.{rest}" for i in range(stacked_counts[modules[0]])]
            sources[tuple(path)] = stacked(keys, layout)
        else:
            sources[tuple(path)] = single(prefix + ".".join([*modules, leaf]), layout)
    return sources
