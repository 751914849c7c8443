"""Reference images in, generated pixels out: the exact pre/post-processing of diffusers' Flux2KleinPipeline.

Preprocessing of one reference (diffusers 0.42 `Flux2KleinPipeline.__call__` + `Flux2ImageProcessor`):

1. reject a side under 64 px or an aspect ratio over 8 (checked on the image as given);
2. if w*h > 1024^2: Lanczos-resize, in the image's own mode, to (int(w*s), int(h*s)), s = sqrt(1024^2 / (w*h));
3. floor both sides to a multiple of the pixels per token (vae_scale_factor x 2: 16 for the klein models);
4. `preprocess(..., resize_mode="crop")`: `Flux2ImageProcessor` overrides `_resize_and_crop` with a plain
   centre crop (offsets (w - W) // 2, (h - H) // 2), so no second resample happens;
5. convert to RGB (after the crop), uint8 / 255 in float32, then 2x - 1.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ml_dtypes
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.paths import check_input_file

MIN_SIDE = 64
MAX_ASPECT = 8
MAX_AREA = 1024 * 1024
# The largest reference read (decoded RGB: 768 MiB on the host before it is scaled to MAX_AREA).
# One limit of our own instead of Pillow's decompression-bomb warning (89 MP) and error (179 MP).
MAX_REFERENCE_SIDE = 16384
MAX_REFERENCE_PIXELS = MAX_REFERENCE_SIDE * MAX_REFERENCE_SIDE


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


@contextmanager
def _own_size_limit() -> Iterator[None]:
    """Pillow's decompression-bomb checks off (its warning is three raw lines): `load_reference` applies
    MAX_REFERENCE_PIXELS itself, from the header, before any pixel is decoded."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def load_reference(path: str | os.PathLike[str]) -> Image.Image:
    """Open a reference image fully (so a truncated file fails here), upright per EXIF, as RGB.

    This is what `diffusers.utils.load_image(path)` returns, so both pipelines see the same pixels.
    """
    p = Path(path)
    check_input_file(p, "reference image", "an image file")
    try:
        with _own_size_limit(), Image.open(p) as opened:
            width, height = opened.size
            if width * height > MAX_REFERENCE_PIXELS:
                raise UserInputError(
                    f"reference image {p} is {width}x{height} ({width * height / 1e6:.0f} megapixels); the limit is "
                    f"{MAX_REFERENCE_PIXELS / 1e6:.0f} megapixels ({MAX_REFERENCE_SIDE}x{MAX_REFERENCE_SIDE}): "
                    "scale it down first"
                )
            opened.load()
            upright = ImageOps.exif_transpose(opened)
            return upright.convert("RGB")
    except PermissionError:
        raise UserInputError(f"cannot read reference image {p}: permission denied") from None
    except UnidentifiedImageError:
        raise UserInputError(f"reference image {p} is not an image file (or not a format Pillow reads)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        # Truncated or corrupt data, unsupported pixel modes, absurd dimensions.
        raise UserInputError(f"cannot read reference image {p}: {_one_line(e)}") from None


def check_reference(image: Image.Image, name: str = "reference image") -> None:
    """The size and aspect checks diffusers runs on every reference before processing any."""
    width, height = image.size
    if width < MIN_SIDE or height < MIN_SIDE:
        raise UserInputError(f"{name} is {width}x{height}; both sides must be at least {MIN_SIDE} px")
    aspect = max(width / height, height / width)
    if aspect > MAX_ASPECT:
        raise UserInputError(
            f"{name} is {width}x{height} (aspect ratio {aspect:.1f}:1); the aspect ratio must be at most {MAX_ASPECT}:1"
        )


def _area_capped_size(width: int, height: int) -> tuple[int, int]:
    if width * height <= MAX_AREA:
        return width, height
    # Same float expression and truncation as diffusers, so the sizes agree to the pixel.
    scale = math.sqrt(MAX_AREA / (width * height))
    return int(width * scale), int(height * scale)


def reference_size(width: int, height: int, *, multiple_of: int) -> tuple[int, int]:
    """The (width, height) a reference of this size has after preprocessing (no pixels needed);
    `multiple_of` is the model's pixels per token (LatentGeometry)."""
    w, h = _area_capped_size(width, height)
    return (w // multiple_of) * multiple_of, (h // multiple_of) * multiple_of


def preprocess_reference(
    image: Image.Image, name: str = "reference image", *, multiple_of: int
) -> np.ndarray:
    """One reference image as diffusers feeds it to the VAE: (H, W, 3) float32 in [-1, 1], cropped
    to a multiple of the model's pixels per token (`multiple_of`, LatentGeometry)."""
    check_reference(image, name)
    capped = _area_capped_size(*image.size)
    if capped != image.size:
        # Resample in the image's own mode, as diffusers does (Pillow premultiplies RGBA and uses nearest for P/1).
        image = image.resize(capped, Image.Resampling.LANCZOS)
    width, height = image.size
    target_w, target_h = (width // multiple_of) * multiple_of, (height // multiple_of) * multiple_of
    left, top = (width - target_w) // 2, (height - target_h) // 2
    image = image.crop((left, top, left + target_w, top + target_h))
    try:
        rgb = image.convert("RGB")
    except ValueError as e:
        raise UserInputError(f"{name} has pixel mode {image.mode} that cannot be converted to RGB: {e}") from None
    pixels = np.asarray(rgb).astype(np.float32) / 255.0
    return 2.0 * pixels - 1.0


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
    x = np.clip((x * half + half).astype(np.float32), 0.0, 1.0)  # clamping to 0/1 is exact in any dtype
    return (x * 255).round().astype(np.uint8)


def validate_size(height: int | None, width: int | None, *, multiple_of: int) -> None:
    """An explicit output size: positive and a multiple of the model's pixels per token
    (`multiple_of`, LatentGeometry; 16 for the published models). None means "not given"."""
    for label, value in (("height", height), ("width", width)):
        if value is None:
            continue
        if value < multiple_of:
            raise UserInputError(f"{label} must be at least {multiple_of} px, got {value}")
        if value % multiple_of:
            lower = value - value % multiple_of
            raise UserInputError(
                f"{label} {value} is not a multiple of {multiple_of}; use {lower} or {lower + multiple_of}"
            )
