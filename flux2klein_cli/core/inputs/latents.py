"""Initial noise given as a file (`latents`): a `.npy` array in diffusers' layout, checked before
its data is read."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.limits import LIMITS, check_file_size
from flux2klein_cli.core.paths import check_input_file


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def _latents_header(f: Any, p: Path, expected: str) -> tuple[tuple[int, ...], np.dtype] | None:
    """The shape and dtype a .npy header declares (None for a format version this numpy reads only
    whole); anything that is not a .npy file is one line, before numpy could suggest pickles."""
    magic = f.read(6)
    f.seek(0)
    if magic[:4] == b"PK\x03\x04":
        raise UserInputError(f"latents file {p} is an .npz archive; save one array of shape {expected} with numpy.save")
    if magic != b"\x93NUMPY":
        raise UserInputError(f"cannot read latents file {p}: not a .npy file (no NumPy header); save one array "
                             f"of shape {expected} with numpy.save")
    version = np.lib.format.read_magic(f)
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in readers:
        f.seek(0)
        return None
    shape, _, dtype = readers[version](f)
    f.seek(0)
    return tuple(int(s) for s in shape), dtype


def load_latents(path: str | os.PathLike[str], expected_shape: Sequence[int]) -> np.ndarray:
    """Initial noise for `--latents`: a `.npy` array of exactly `expected_shape`, diffusers'
    (B, C, H/p, W/p) with p the model's pixels per token (LatentGeometry.latents_shape).

    Returns float32; any float dtype on disk is accepted (diffusers casts `latents=` to the pipeline dtype too).
    The header is checked (shape, dtype) before any data is read, and the file's size against the limits table.
    """
    p = Path(path).expanduser()
    expected = _shape(expected_shape)
    want = tuple(int(s) for s in expected_shape)
    check_input_file(p, "latents file", "a .npy file")
    check_file_size(p, LIMITS.latents_bytes, "latents file")

    def check(shape: tuple[int, ...], dtype: np.dtype) -> None:
        if dtype.hasobject:
            raise UserInputError(f"cannot read latents file {p}: it holds Python objects (dtype {dtype}); "
                                 f"expected a float array of shape {expected}")
        if dtype.kind != "f":
            raise UserInputError(f"latents in {p} have dtype {dtype}; expected a float array of shape {expected}")
        if shape != want:
            raise UserInputError(
                f"latents in {p} have shape {_shape(shape)}; expected {expected} "
                "(batch, latent channels, height and width in tokens)"
            )

    try:
        with open(p, "rb") as f:
            header = _latents_header(f, p, expected)
            if header is not None:
                check(*header)
            loaded = np.lib.format.read_array(f, allow_pickle=False)
    except PermissionError:
        raise UserInputError(f"cannot read latents file {p}: permission denied") from None
    except (OSError, ValueError, EOFError, SyntaxError) as e:
        raise UserInputError(f"cannot read latents file {p} as a .npy array: {' '.join(str(e).split())}") from None
    check(tuple(loaded.shape), loaded.dtype)
    latents = np.ascontiguousarray(loaded, dtype=np.float32)
    if not np.isfinite(latents).all():
        raise UserInputError(f"latents in {p} contain NaN or infinite values")
    return latents
