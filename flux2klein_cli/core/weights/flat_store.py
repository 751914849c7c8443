"""The flat layout of a converted component: parameters stored as the model holds them, mapped, not read.

Its index and data file header, and the checks made on them before anything is mapped, are in
flat_index.py. Every parameter is stored exactly as it lives in host memory: in its target
dtype, in JAX layout (linear kernels (in, out), convolutions HWIO), scanned layers already
stacked, C order. Loading maps the file read-only and hands each parameter to JAX as a view of
the mapping (mapped.py): on a CPU host no byte is copied and no new memory is used. Nothing
writes through the mapping: it is read-only, and donating a mapped parameter to a jitted
function gives the array up without writing into it (the output gets a buffer of its own;
tested). A CPU device adopts a sharded slice as it is when it is contiguous and aligned (a
row-sharded slice) and gets one aligned copy of anything else (or a dtype cast).

The bytes of the parameters themselves are not hashed at load (that would mean reading all of
them, which is exactly what this layout avoids); each one's CRC-32 is in the index, and
`verify` checks them all.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.weights.flat_index import (
    ALIGNMENT,
    DATA_FILE,
    DTYPES,
    HEADER,
    HEADER_BYTES,
    INDEX_FILE,
    MAGIC,
    VERSION,
    FlatIndex,
    FlatTensor,
    index_json,
    read_index,
)
from flux2klein_cli.core.weights.loader import aligned_empty, raise_on_mismatch
from flux2klein_cli.core.weights.mapped import map_readonly, place_views, view, whole

_CHUNK_BYTES = 64 << 20  # written per system call, from one reused buffer
# One parameter to write: its name, shape, dtype, and `fill(out, index)`, which writes the
# parameter's slice `index` (() for all of it, or slices of its leading axes) into `out`.
TensorWriter = tuple[str, tuple[int, ...], np.dtype, Callable[[np.ndarray, tuple[slice, ...]], None]]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# ----------------------------------------------------------------------------- writing


def _chunks(shape: tuple[int, ...], itemsize: int, budget: int) -> Iterator[tuple[slice, ...]]:
    """Slices of leading axes that cut a C-ordered array into contiguous pieces of at most `budget`
    bytes (or one row of the last axis, if that is larger), in storage order."""
    if not shape:
        yield ()
        return
    row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    if row <= budget or len(shape) == 1:
        step = max(1, budget // max(row, 1))
        for start in range(0, shape[0], step):
            yield (slice(start, min(start + step, shape[0])),)
        return
    for i in range(shape[0]):
        for rest in _chunks(shape[1:], itemsize, budget):
            yield (slice(i, i + 1), *rest)


def _chunk_start(shape: tuple[int, ...], index: tuple[slice, ...]) -> int:
    """The element offset where a `_chunks` piece begins."""
    strides = [int(np.prod(shape[k + 1 :], dtype=np.int64)) for k in range(len(shape))]
    return sum(s.start * stride for s, stride in zip(index, strides, strict=False))


def write_flat(directory: str | Path, tensors: Sequence[TensorWriter],
               progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Write `tensors` into `directory` (created; it must not exist) in the flat layout.

    Each parameter is produced in pieces of at most 64 MiB into one reused aligned buffer and
    written with `pwrite` (peak memory: that buffer, plus the source pages being read). Plain
    writes, rather than stores into a writable mapping, let the page cache keep the file in
    large folios, which later loads map with far fewer page faults (the 4B transformer's pages
    were touched in 0.1 s instead of 0.7 s). The index and the header are written after the
    data, and everything is fsynced: a directory whose index and header agree is complete.
    `progress(bytes_done)` is called after each parameter. Returns the index's summary."""
    directory = Path(directory)
    directory.mkdir(parents=True)
    entries: dict[str, FlatTensor] = {}
    offset = HEADER_BYTES
    for key, shape, dtype, _ in tensors:
        if key in entries:
            raise ValueError(f"duplicate tensor name {key!r}")
        if np.dtype(dtype).name not in DTYPES:
            raise ValueError(f"{key}: dtype {np.dtype(dtype).name} cannot be stored")
        entries[key] = FlatTensor(np.dtype(dtype), tuple(int(d) for d in shape), offset)
        offset = _round_up(offset + max(entries[key].nbytes, 1), ALIGNMENT)
    total = offset
    conversion_id = uuid.uuid4()
    scratch = aligned_empty((_CHUNK_BYTES,), np.dtype(np.uint8))
    done = 0
    fd = os.open(directory / DATA_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, total)
        for key, _, _, fill in tensors:
            entry = entries[key]
            crc = 0
            for index in _chunks(entry.shape, entry.dtype.itemsize, _CHUNK_BYTES):
                shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, entry.shape, strict=False)) \
                    + entry.shape[len(index):]
                nbytes = int(np.prod(shape, dtype=np.int64)) * entry.dtype.itemsize
                if nbytes > scratch.nbytes:  # one row of the last axis over 64 MiB
                    scratch = aligned_empty((nbytes,), np.dtype(np.uint8))
                out = scratch[:nbytes].view(entry.dtype).reshape(shape)
                fill(out, index)
                data = scratch[:nbytes]
                crc = zlib.crc32(data, crc)
                position = entry.offset + _chunk_start(entry.shape, index) * entry.dtype.itemsize
                while data.nbytes:  # pwrite may write less than asked
                    written = os.pwrite(fd, data, position)
                    data, position = data[written:], position + written
            entries[key] = FlatTensor(entry.dtype, entry.shape, entry.offset, crc)
            done += entry.nbytes
            if progress:
                progress(done)
        index_bytes = index_json(conversion_id.hex, total, entries)
        os.pwrite(fd, HEADER.pack(MAGIC, VERSION, conversion_id.bytes, hashlib.sha256(index_bytes).digest()), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    with (directory / INDEX_FILE).open("xb") as f:
        f.write(index_bytes)
        f.flush()
        os.fsync(f.fileno())
    return {"id": conversion_id.hex, "bytes": total}


# ----------------------------------------------------------------------------- reading


def _map(index: FlatIndex) -> mmap.mmap:
    return map_readonly(index.data_file)


def _view(mapping: mmap.mmap, entry: FlatTensor) -> np.ndarray:
    return view(mapping, entry.dtype, entry.shape, entry.offset)


def load_arrays(directory: str | Path, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Each target's array (shape, dtype, sharding) from a flat component directory; see the module
    docstring. Missing, unexpected and reshaped parameters are one CheckpointError, as for the
    other loaders."""
    index = read_index(directory)
    raise_on_mismatch(
        index.data_file,
        missing=set(targets) - set(index.tensors),
        unexpected=set(index.tensors) - set(targets),
        wrong=[f"{k} is {index.tensors[k].shape}, model expects {tuple(targets[k].shape)}"
               for k in sorted(set(targets) & set(index.tensors)) if index.tensors[k].shape != tuple(targets[k].shape)],
    )
    mapping = _map(index)
    placed = place_views({key: whole(_view(mapping, index.tensors[key])) for key in targets}, targets)
    return {key: placed[key] for key in targets}


def verify(directory: str | Path) -> None:
    """Read every parameter once and check its CRC-32: a CheckpointError names the damaged ones."""
    index = read_index(directory)
    mapping = _map(index)
    bad = [key for key, entry in index.tensors.items()
           if entry.crc32 is not None and zlib.crc32(_view(mapping, entry).reshape(-1).view(np.uint8)) != entry.crc32]
    if bad:
        more = f" (and {len(bad) - 10} more)" if len(bad) > 10 else ""
        raise CheckpointError(f"{Path(directory) / DATA_FILE}: damaged parameters (CRC-32 mismatch): "
                              f"{', '.join(bad[:10])}{more}")
