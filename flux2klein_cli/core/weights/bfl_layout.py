"""A BFL single-file transformer seen in diffusers' key names, without converting a byte.

Each diffusers parameter of a BFL file is a byte range of one stored tensor: a fused qkv
holds q, k and v as consecutive row ranges of its C-ordered (out, in) matrix, so splitting
it is only arithmetic on offsets, and the loader reads each part straight from the mapped
file as it reads any other tensor. The one tensor not a single range is norm_out's
modulation, whose two halves BFL stores in the other order (flagged `swap_halves`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.weights.bfl_names import diffusers_parameters, strip_prefix

if TYPE_CHECKING:  # safetensors_io applies this view when it opens a file: a type name only here
    from flux2klein_cli.core.weights.safetensors_io import TensorInfo

# Module names only BFL's layout has: one of them in a file means BFL keys.
_BFL_MARKERS = ("double_blocks.", "single_blocks.", "img_in.", "txt_in.", "final_layer.")


def is_bfl(keys: Mapping[str, object]) -> bool:
    return any(strip_prefix(key).startswith(_BFL_MARKERS) for key in keys)


def as_diffusers(tensors: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The tensors of a BFL file under diffusers' keys; a key BFL's transformer does not have
    keeps its name (the loader's key check then reports it as unexpected)."""
    out: dict[str, TensorInfo] = {}
    for key, info in tensors.items():
        mapped = diffusers_parameters(key)
        if mapped is None:
            out[key] = info
            continue
        for name, part in mapped:
            rows = info.shape[0] if info.shape else 0
            if part.of > 1 and rows % part.of:
                raise CheckpointError(f"{info.file}: {key} has {rows} rows, not {part.of} equal parts")
            if part.swap_halves and rows % 2:
                raise CheckpointError(f"{info.file}: {key} has {rows} rows, not two equal halves")
            count = rows // part.of
            size = (info.end - info.start) // part.of
            start = info.start + part.index * size
            out[name] = replace(info, shape=(count, *info.shape[1:]), start=start, end=start + size, stored_key=key,
                                rows=(part.index * count, (part.index + 1) * count) if part.of > 1 else None,
                                swap_halves=part.swap_halves)
    return out
