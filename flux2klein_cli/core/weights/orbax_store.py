"""The Orbax layout of a converted component (`convert --layout orbax`; see converted.py for the
directory and why there are two layouts): writing it, and restoring it into target shardings.

    <component>/orbax/   one Orbax PyTree checkpoint: parameter name -> array (uncompressed,
                         chunked by layer for stacked parameters, else chunks of <= 128 MiB)

Parameters are stored in JAX layout and in the target dtype, chunked for the sharding they were
written for; a restore reads each device's slice of each array straight into place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.weights.loader import aligned_empty, raise_on_mismatch, unique_shards

ORBAX_DIR = "orbax"
_READ_BUDGET = 512 << 20  # bytes being read at once when restoring (or one array, if larger)
_CHUNK_BYTES = 128 << 20


def _storage_options(ocp: Any) -> Callable[[Any, Any], Any]:
    """Per-array chunking: a stacked parameter (leading layer axis) is chunked by layers, so every
    chunk is one contiguous slab of the array and a read is a straight copy; anything else gets
    chunks of at most 128 MiB (row bands for a big embedding). Many chunks let TensorStore read
    in parallel, and a device that owns a shard reads little more than its shard."""
    storage = ocp.options.ArrayOptions.Saving.StorageOptions

    def options(_keypath: Any, value: Any) -> Any:
        if getattr(value, "ndim", 0) >= 3 and value.nbytes > _CHUNK_BYTES:
            return storage(shard_axes=(0,))
        return storage(chunk_byte_size=_CHUNK_BYTES)

    return options


@contextmanager
def orbax_context() -> Iterator[Any]:
    """Orbax's v1 API with our storage options: uncompressed (weights barely compress, and zstd
    would cost more time at load than it saves in reading) and chunked as above."""
    import orbax.checkpoint.experimental.v1 as ocp

    context = ocp.Context()
    context.array.saving.use_compression = False
    context.array.saving.scoped_storage_options_creator = _storage_options(ocp)
    with context:
        yield ocp


def write_orbax(target: Path, arrays: Iterable[tuple[str, jax.Array]], group_bytes: int,
                progress: Callable[[int], None] | None = None) -> None:
    """Write named arrays as one Orbax checkpoint at `target`, handing them to Orbax in groups of
    about `group_bytes` (`ocp.partial.save`) merged at the end (`ocp.partial.finalize`).
    `progress(bytes_done)` is called after each group. Orbax stages a host copy of what it writes,
    so the peak is about twice the largest parameter or group over the baseline (for the 4B
    transformer, whose largest stacked parameter is 3.4 GB: 7.7 GB, about the model's size)."""
    done, group, group_size = 0, {}, 0
    with orbax_context() as ocp:
        for key, array in arrays:
            group[key] = array
            group_size += array.nbytes
            if group_size >= group_bytes:
                ocp.partial.save(target, group)
                done += group_size
                group, group_size = {}, 0
                if progress:
                    progress(done)
        if group:
            ocp.partial.save(target, group)
            done += group_size
            if progress:
                progress(done)
        group = {}
        ocp.partial.finalize(target)


def restore_arrays(checkpoint: Path, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Read an Orbax PyTree checkpoint's arrays into `targets` (shape, dtype, sharding).

    The arrays are opened with the TensorStore specs Orbax itself reads them with, then each
    addressable shard is written by TensorStore straight into an aligned host buffer that the
    device adopts (on CPU without a copy; on an accelerator the buffer is transferred and freed).
    `ocp.load` does the same but reads into a buffer of its own and then copies it, which on
    this project's CPU hosts made it 1.6-2x slower and peak at 1.4x the model instead of 1.03x.
    At most `_READ_BUDGET` bytes (or one array, if larger) are in flight."""
    import tensorstore as ts
    from etils import epath
    from orbax.checkpoint import type_handlers

    stored = _stored_arrays(checkpoint)
    _check_keys(checkpoint, stored, targets)
    state = checkpoint / "state"  # the PyTree checkpointable that `ocp.partial.save` writes
    context = type_handlers.get_ts_context(use_ocdbt=True)
    opened = {}
    for key in targets:
        info = type_handlers.ParamInfo(name=key, parent_dir=epath.Path(state), use_zarr3=True, ts_context=context)
        opened[key] = ts.open(type_handlers.get_json_tspec_read(info, use_ocdbt=True), open=True, context=context)

    results: dict[str, jax.Array] = {}
    in_flight: list[tuple[int, Callable[[], None]]] = []
    budget = 0

    def drain(limit: int) -> None:
        nonlocal budget
        while in_flight and budget > limit:
            size, finish = in_flight.pop(0)
            finish()
            budget -= size

    for key, target in targets.items():
        try:
            store = opened[key].result()
        except ValueError as e:
            raise CheckpointError(f"{checkpoint}: cannot open {key} ({str(e).splitlines()[0]})") from None
        if store.dtype.numpy_dtype != np.dtype(target.dtype):
            store = ts.cast(store, ts.dtype(np.dtype(target.dtype).name))
        pieces: list[tuple[jax.Device, np.ndarray, Any]] = []
        for index, devices in unique_shards(target.sharding, target.shape):
            shard_shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, target.shape, strict=True))
            buffer = aligned_empty(shard_shape, np.dtype(target.dtype))
            write = ts.array(buffer).write(store[index] if index else store)
            pieces.extend((device, buffer, write) for device in devices)

        def finish(key: str = key, target: jax.ShapeDtypeStruct = target, pieces: list = pieces) -> None:
            arrays = []
            for device, buffer, write in pieces:
                try:
                    write.result()
                except ValueError as e:
                    raise CheckpointError(f"{checkpoint}: cannot read {key} ({str(e).splitlines()[0]})") from None
                arrays.append(jax.device_put(buffer, device))
            results[key] = jax.make_array_from_single_device_arrays(target.shape, target.sharding, arrays)

        size = int(np.prod(target.shape)) * np.dtype(target.dtype).itemsize
        in_flight.append((size, finish))
        budget += size
        drain(_READ_BUDGET)
    drain(-1)
    return results


def _stored_arrays(checkpoint: Path) -> dict[str, Any]:
    """Name -> metadata (shape, dtype) of every array in a checkpoint, from Orbax's own metadata."""
    with orbax_context() as ocp:
        try:
            stored = ocp.metadata(checkpoint).metadata
        except (OSError, ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"{checkpoint}: unreadable Orbax checkpoint ({str(e).splitlines()[0]})") from None
    if not isinstance(stored, dict):
        raise CheckpointError(f"{checkpoint}: unexpected checkpoint structure")
    return stored


def _check_keys(where: Path, stored: Any, targets: dict[str, jax.ShapeDtypeStruct]) -> None:
    """The same strictness and message as the safetensors loader: missing, unexpected, reshaped."""
    raise_on_mismatch(
        where,
        missing=set(targets) - set(stored),
        unexpected=set(stored) - set(targets),
        wrong=[f"{k} is {tuple(stored[k].shape)}, model expects {tuple(targets[k].shape)}"
               for k in sorted(set(stored) & set(targets)) if tuple(stored[k].shape) != tuple(targets[k].shape)],
    )


def check_converted(root: str | Path) -> dict[str, Any]:
    """Kept for callers that import it from here; see converted.check_converted."""
    from flux2klein_cli.core.weights.converted import check_converted as check

    return check(root)
