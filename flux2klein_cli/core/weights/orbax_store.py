"""The Orbax layout of a converted component (`convert --layout orbax`; see converted.py for the
directory and why there are two layouts): writing it, and restoring it into target shardings.

    <component>/orbax/                    one Orbax PyTree checkpoint: parameter name -> array
    <component>/orbax/state/<name>/       that array in zarr (v2) form, uncompressed, one chunk
                                          per shard it was written with (one, unsharded): the
                                          chunk file `0.0...` holds the raw C-ordered bytes

Parameters are stored in JAX layout and in the target dtype. Written this way (no OCDBT, no
compression, chunks as large as the shards), every chunk file is exactly the bytes of one
device's slice, so a restore maps the chunk files and places them as the flat layout does
(mapped.py): on a CPU host no byte is copied. Anything else in an Orbax checkpoint (OCDBT, as
this project wrote before, compression, another chunking, a load sharding that cuts chunks) is
restored by TensorStore, with the specs Orbax itself reads them with.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.weights.loader import aligned_empty, raise_on_mismatch, unique_shards
from flux2klein_cli.core.weights.mapped import Piece, map_readonly, place_views, view

ORBAX_DIR = "orbax"
_READ_BUDGET = 512 << 20  # bytes being read at once by TensorStore (or one array, if larger)


def _storage_options(ocp: Any) -> Callable[[Any, Any], Any]:
    """One chunk per written shard (Orbax never makes a chunk larger than what one device writes),
    so each chunk file is one device's whole slice."""
    storage = ocp.options.ArrayOptions.Saving.StorageOptions
    return lambda _keypath, value: storage(chunk_byte_size=max(int(value.nbytes), 1))


# What Orbax logs (through absl) for the options chosen here on purpose: small arrays get small chunks
# ("target_byte_size too small", once per array: ~290 lines for a klein model) and there is no OCDBT
# to merge. Neither is news to the user; anything else Orbax logs still shows.
_EXPECTED_LOGS = ("Setting the target_byte_size too small", "Skipping merge of OCDBT checkpoints")


class _ExpectedOrbaxLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in _EXPECTED_LOGS)


_LOG_FILTER = _ExpectedOrbaxLogs()


@contextmanager
def orbax_context() -> Iterator[Any]:
    """Orbax's v1 API writing plain zarr (v2) arrays, one directory per array, uncompressed
    (weights barely compress) and chunked as above: the chunk files can be mapped as they are."""
    import orbax.checkpoint.experimental.v1 as ocp

    context = ocp.Context()
    context.array.saving.use_ocdbt = False
    context.array.saving.use_zarr3 = False
    context.array.saving.use_compression = False
    # A replicated array is written whole, not split among its replicas: one chunk, one file.
    context.array.saving.use_replica_parallel = False
    context.array.saving.scoped_storage_options_creator = _storage_options(ocp)
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(_LOG_FILTER)
    try:
        with context:
            yield ocp
    finally:
        absl_logger.removeFilter(_LOG_FILTER)


def write_orbax(target: Path, arrays: Iterable[tuple[str, jax.Array]], group_bytes: int,
                progress: Callable[[int], None] | None = None) -> None:
    """Write named arrays as one Orbax checkpoint at `target`, handing them to Orbax in groups of
    about `group_bytes` (`ocp.partial.save`) merged at the end (`ocp.partial.finalize`).
    `progress(bytes_done)` is called after each group. Orbax stages a host copy of what it writes,
    so the peak is about twice the largest parameter or group over the baseline (for the 4B
    transformer, whose largest stacked parameter is 3.4 GB: 7.7 GB, about the model's size).

    The writing runs in a thread of its own that the caller's thread waits for: Orbax writes from
    threads of its own too, which an interrupt of the caller (cli/main.py raises it in the main
    thread) would not stop, so they would go on creating files in a temporary directory already being
    removed (`.NAME.partial-.../orbax.partial_save`). On an interrupt or error the writer is told to
    stop after the group in flight and is waited for; only then does the exception go on."""
    stop, finished = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def write() -> None:
        try:
            _write_groups(target, arrays, group_bytes, progress, stop)
        except BaseException as e:  # handed to the waiting thread
            failed.append(e)
        finally:
            finished.set()

    # Waited for on an Event, not Thread.join: a join interrupted by the signal handler's exception
    # can mark a running thread as stopped (CPython bpo-45274), and the next join returns at once.
    threading.Thread(target=write, name="flux2klein-orbax-write", daemon=True).start()
    try:
        while not finished.wait(0.05):  # short waits: the signal handler runs between them
            pass
    except BaseException:
        stop.set()
        finished.wait()  # Orbax's writes in flight end before the temporary directory goes
        raise
    if failed:
        raise failed[0]


def _write_groups(target: Path, arrays: Iterable[tuple[str, jax.Array]], group_bytes: int,
                  progress: Callable[[int], None] | None, stop: threading.Event) -> None:
    done, group, group_size = 0, {}, 0
    with orbax_context() as ocp:
        for key, array in arrays:
            if stop.is_set():
                return
            group[key] = array
            group_size += array.nbytes
            if group_size >= group_bytes:
                ocp.partial.save(target, group)
                done += group_size
                group, group_size = {}, 0
                if progress:
                    progress(done)
        if stop.is_set():
            return
        if group:
            ocp.partial.save(target, group)
            done += group_size
            if progress:
                progress(done)
        group = {}
        if not stop.is_set():
            ocp.partial.finalize(target)


def restore_arrays(checkpoint: Path, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Read an Orbax PyTree checkpoint's arrays into `targets` (shape, dtype, sharding): mapped
    from their raw chunk files where each device's slice is one chunk (see the module docstring),
    the rest through TensorStore."""
    state = checkpoint / "state"  # the PyTree checkpointable that `ocp.partial.save` writes
    meta = _tree_metadata(state)
    zarrays = _zarr_v2_arrays(state, meta)
    # Orbax's own metadata reader costs an import and a TensorStore open per array (0.4 s and
    # 0.35 s for the VAE's 250): read only where the plain zarr metadata is not there.
    shapes = ({key: tuple(array.get("shape") or ()) for key, array in zarrays.items()} if zarrays is not None
              else {key: tuple(value.shape) for key, value in _stored_arrays(checkpoint).items()})
    _check_keys(checkpoint, shapes, targets)
    mapped: dict[str, Piece] = {}
    for key, target in targets.items():
        piece = _raw_chunks(state / key, zarrays[key], target) if zarrays is not None else None
        if piece is not None:
            mapped[key] = piece
    results = place_views(mapped, targets)
    rest = {key: target for key, target in targets.items() if key not in mapped}
    if rest:
        # Orbax records both flags; checkpoints this project wrote before the raw chunks used both.
        flags = bool(meta.get("use_ocdbt", True)), bool(meta.get("use_zarr3", True))
        results.update(_restore_with_tensorstore(checkpoint, state, rest, *flags))
    return {key: results[key] for key in targets}


def _tree_metadata(state: Path) -> dict[str, Any]:
    """Orbax's _METADATA of a PyTree checkpoint ({} when unreadable: Orbax's reader then says why)."""
    try:
        meta = json.loads((state / "_METADATA").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _zarr_v2_arrays(state: Path, meta: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """Name -> zarr (v2) metadata of every array the tree metadata `meta` lists, when the
    checkpoint holds them as plain zarr v2 arrays (no OCDBT); else None."""
    try:
        if meta.get("use_ocdbt", True) or meta.get("use_zarr3", True):
            return None
        arrays = {}
        for entry in meta["tree_metadata"].values():
            (key,) = (k["key"] for k in entry["key_metadata"])  # a flat dict of arrays: one key each
            arrays[str(key)] = json.loads((state / str(key) / ".zarray").read_text())
        return arrays
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _zarr_dtype(name: Any) -> np.dtype | None:
    """The numpy dtype of a zarr v2 dtype string, if it is one stored little-endian (or bytewise)."""
    if name == "bfloat16":  # TensorStore's name; zarr v2 has no standard one
        return np.dtype(ml_dtypes.bfloat16)
    if not isinstance(name, str) or name[:1] not in ("<", "|"):
        return None
    try:
        return np.dtype(name)
    except TypeError:
        return None


def _raw_chunks(directory: Path, meta: dict[str, Any], target: jax.ShapeDtypeStruct) -> Piece | None:
    """The array's pieces as views of its mapped chunk files, when it is stored raw (`meta`, its
    .zarray: uncompressed, unfiltered, C order, little-endian) and every distinct device slice of
    `target` is exactly one chunk; else None. A raw chunk file that is missing or of the wrong
    size is a CheckpointError: TensorStore would read a missing chunk as zeros."""
    dtype = _zarr_dtype(meta.get("dtype"))
    shape, chunks = tuple(target.shape), tuple(meta.get("chunks") or ())
    raw = (meta.get("zarr_format") == 2 and meta.get("compressor") is None and not meta.get("filters")
           and meta.get("order", "C") == "C" and dtype is not None and tuple(meta.get("shape") or ()) == shape
           and len(chunks) == len(shape) and all(c > 0 for c in chunks))
    if not raw or math.prod(shape) == 0:
        return None
    files: dict[tuple[tuple[int, int], ...], Path] = {}
    for slices, _ in unique_shards(target.sharding, shape):
        bounds = _bounds(slices, shape)
        if any(lo % c or hi - lo != c for (lo, hi), c in zip(bounds, chunks, strict=True)):
            return None  # a device slice that is not one whole chunk: TensorStore assembles it
        coords = [str(lo // c) for (lo, _), c in zip(bounds, chunks, strict=True)] or ["0"]
        files[bounds] = directory / meta.get("dimension_separator", ".").join(coords)
    nbytes = math.prod(chunks) * dtype.itemsize
    for path in files.values():
        size = path.stat().st_size if path.is_file() else None
        if size != nbytes:
            found = "missing" if size is None else f"{size} bytes, expected {nbytes}"
            raise CheckpointError(f"{path}: damaged Orbax chunk ({found})")
    views = {bounds: view(map_readonly(path), dtype, chunks) for bounds, path in files.items()}

    return lambda slices: views[_bounds(slices, shape)]


def _bounds(slices: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(start, stop) per dimension of a device's slice."""
    return tuple(s.indices(n)[:2] for s, n in zip(slices, shape, strict=True))


def _restore_with_tensorstore(checkpoint: Path, state: Path, targets: dict[str, jax.ShapeDtypeStruct],
                              use_ocdbt: bool, use_zarr3: bool) -> dict[str, jax.Array]:
    """The arrays opened with the TensorStore specs Orbax itself reads them with, then each
    addressable shard written by TensorStore straight into an aligned host buffer that the
    device adopts (on CPU without a copy; on an accelerator the buffer is transferred and freed).
    `ocp.load` does the same but reads into a buffer of its own and then copies it, which on
    this project's CPU hosts made it 1.6-2x slower and peak at 1.4x the model instead of 1.03x.
    At most `_READ_BUDGET` bytes (or one array, if larger) are in flight."""
    import tensorstore as ts
    from etils import epath
    from orbax.checkpoint import type_handlers

    context = type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
    opened = {}
    for key in targets:
        info = type_handlers.ParamInfo(name=key, parent_dir=epath.Path(state), use_zarr3=use_zarr3, ts_context=context)
        opened[key] = ts.open(type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt), open=True, context=context)

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


def _check_keys(where: Path, shapes: dict[str, tuple[int, ...]], targets: dict[str, jax.ShapeDtypeStruct]) -> None:
    """The same strictness and message as the safetensors loader: missing, unexpected, reshaped."""
    raise_on_mismatch(
        where,
        missing=set(targets) - set(shapes),
        unexpected=set(shapes) - set(targets),
        wrong=[f"{k} is {shapes[k]}, model expects {tuple(targets[k].shape)}"
               for k in sorted(set(shapes) & set(targets)) if shapes[k] != tuple(targets[k].shape)],
    )

