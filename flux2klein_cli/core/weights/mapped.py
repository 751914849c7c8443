"""Parameters as views of read-only file mappings, placed into their target shardings.

Both converted layouts store each parameter in its target dtype and JAX layout, contiguous and
page-aligned in a file (flat_store.py: one file per component; orbax_store.py: one raw chunk
file per array), so a load maps the files and never reads them itself. JAX's CPU client adopts
a host buffer aligned to 64 bytes as the array's own storage instead of copying it: on a CPU
host a parameter is then the page cache's pages, with no copy and no new memory. Each array
holds its numpy view, which holds the mapping, so a mapping lives exactly as long as the last
array that uses it. With a sharding (several devices, or an accelerator), each device's slice
is cut from the mapping and placed with `device_put`.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from flux2klein_cli.core.weights.loader import aligned_empty, copy_into, unique_shards

ZERO_COPY_ALIGNMENT = 64  # what JAX's CPU client needs to adopt a host buffer instead of copying it


def map_readonly(path: Path) -> mmap.mmap:
    """`path` mapped read-only. WILLNEED starts reading it into the page cache in the background
    (from a cold cache the disk streams while the model is being built and compiled)."""
    with path.open("rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_WILLNEED"):
        mapping.madvise(mmap.MADV_WILLNEED)
    return mapping


def view(mapping: mmap.mmap, dtype: np.dtype, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
    """The C-ordered array of `dtype` and `shape` stored at `offset` of the mapping."""
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(mapping, dtype, count=count, offset=offset).reshape(shape)


def host_piece(piece: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A device's host bytes: the mapped view itself when it can be adopted (or transferred) as
    it is, else one aligned copy in the target dtype."""
    if piece.dtype == dtype and piece.flags.c_contiguous and piece.ctypes.data % ZERO_COPY_ALIGNMENT == 0:
        return piece
    out = aligned_empty(piece.shape, dtype)
    copy_into(out, piece)
    return out


# The stored bytes of one slice of an array (all of it for `()`), a view of a mapping where possible.
Piece = Callable[[tuple[slice, ...]], np.ndarray]


def whole(stored: np.ndarray) -> Piece:
    """Pieces cut from one stored array."""
    return lambda slices: stored[slices] if slices else stored


def place_views(pieces: dict[str, Piece], targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Each target's array (shape, dtype, sharding) from its stored pieces, one per distinct device
    slice; cast on the way when the dtypes differ. Keys and shapes must have been checked by the
    caller."""
    results: dict[str, jax.Array] = {}
    replicated: list[tuple[str, np.ndarray]] = []  # arrays every device holds entirely: placed in one batch
    for key, piece in pieces.items():
        target = targets[key]
        dtype = np.dtype(target.dtype)
        shards = unique_shards(target.sharding, target.shape)
        if len(shards) == 1:
            replicated.append((key, host_piece(piece(shards[0][0]), dtype)))
            continue
        arrays = []
        for slices, devices in shards:
            host = host_piece(piece(slices), dtype)
            arrays.extend(jax.device_put(host, device) for device in devices)
        results[key] = jax.make_array_from_single_device_arrays(target.shape, target.sharding, arrays)
    if replicated:
        # One call for all of them: about 3x less overhead per array than one device_put each.
        placed = jax.device_put([host for _, host in replicated], [targets[key].sharding for key, _ in replicated])
        results.update(zip([key for key, _ in replicated], placed, strict=True))
    return results
