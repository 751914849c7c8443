"""Latent packing and the 4-axis (t, h, w, l) position ids of text, image and reference tokens."""

from __future__ import annotations

import jax
import numpy as np

REFERENCE_T_SCALE = 10  # reference i (0-based) sits at t = 10 + 10 * i


def text_ids(length: int) -> np.ndarray:
    ids = np.zeros((length, 4), np.int32)
    ids[:, 3] = np.arange(length)
    return ids


def image_ids(height: int, width: int, t: int = 0) -> np.ndarray:
    """(height * width, 4) ids of a token grid, row-major, as the tokens are packed."""
    hh, ww = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    return np.stack([np.full(height * width, t), hh.ravel(), ww.ravel(), np.zeros(height * width)], -1).astype(
        np.int32
    )


def reference_ids(grids: list[tuple[int, int]]) -> np.ndarray:
    """Ids of all references' tokens, concatenated in order; (0, 4) when there are none."""
    if not grids:
        return np.zeros((0, 4), np.int32)
    return np.concatenate(
        [image_ids(h, w, REFERENCE_T_SCALE + REFERENCE_T_SCALE * i) for i, (h, w) in enumerate(grids)]
    )


def pack_nhwc(latents: jax.Array) -> jax.Array:
    """(B, h, w, C) VAE latents -> (B, h * w, C) tokens."""
    b, h, w, c = latents.shape
    return latents.reshape(b, h * w, c)

