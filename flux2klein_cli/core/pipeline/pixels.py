"""Decoded pixels out: uint8 images as diffusers' postprocess gives them, and a padding mask
crop's images pasted back into the init image (the inverse of core/inputs' crop: diffusers'
resize mode "crop" and `apply_overlay`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from PIL import Image


def postprocess(images: np.ndarray) -> np.ndarray:
    """Decoded images (B, H, W, 3) in about [-1, 1] -> uint8, as diffusers' postprocess(output_type="pil").

    Denormalise and clamp in the input's own dtype (diffusers does it on the VAE output tensor, bf16 included),
    then float32, * 255, round half to even, uint8.
    """
    x = np.asarray(images)
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"expected images of shape (B, H, W, 3), got {x.shape}")
    if not np.issubdtype(x.dtype, np.floating) and x.dtype != ml_dtypes.bfloat16:
        x = x.astype(np.float32)
    # A typed 0.5: bf16 * a Python float would promote to float32 and round differently from diffusers.
    half = np.asarray(0.5, dtype=x.dtype)
    y = x * half  # a new array: the passes below work in place (a 512x512 image is on serve's path)
    y += half
    y = y.astype(np.float32, copy=False)
    np.clip(y, 0.0, 1.0, out=y)  # clamping to 0/1 is exact in any dtype
    y *= 255
    np.rint(y, out=y)  # round half to even, as torch's round
    return y.astype(np.uint8)


def _cover(image: Image.Image, width: int, height: int) -> Image.Image:
    """`image` Lanczos-resized to cover (width, height) keeping its aspect, centre-cropped to it
    (diffusers' "crop"): with the box at the output's aspect, a plain resize up to rounding."""
    ratio, source = width / height, image.width / image.height
    w = width if ratio > source else image.width * height // image.height
    h = height if ratio <= source else image.height * width // image.width
    out = Image.new("RGB", (width, height))
    out.paste(image.resize((w, h), resample=Image.Resampling.LANCZOS), box=(width // 2 - w // 2, height // 2 - h // 2))
    return out


def paste_back(images: np.ndarray, original: np.ndarray, mask: np.ndarray,
               box: tuple[int, int, int, int]) -> np.ndarray:
    """(B, H, W, 3) uint8 images made at the crop's size, each resized into `box` of a transparent
    canvas the init image's size, then the init image (`original`: (H, W, 4) RGBA uint8) laid over
    it with opacity 255 - `mask` ((H, W) uint8, white = repaint; gray levels as given, not
    binarised): black outside the box where the mask is white, which a mask inside its box never is."""
    height, width = mask.shape
    keep = Image.new("RGBa", (width, height))
    keep.paste(Image.fromarray(original, "RGBA").convert("RGBa"), mask=Image.fromarray(255 - mask, "L"))
    keep = keep.convert("RGBA")
    x1, y1, x2, y2 = box
    out = []
    for image in images:
        canvas = Image.new("RGBA", (width, height))
        canvas.paste(_cover(Image.fromarray(image, "RGB"), x2 - x1, y2 - y1), (x1, y1))
        layered = canvas.convert("RGB").convert("RGBA")
        layered.alpha_composite(keep)
        out.append(np.asarray(layered.convert("RGB")))
    return np.stack(out)
