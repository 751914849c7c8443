"""Reference images in: the exact preprocessing of diffusers' Flux2KleinPipeline.

Preprocessing of one reference (diffusers 0.42 `Flux2KleinPipeline.__call__` + `Flux2ImageProcessor`):

1. reject a side under 64 px or an aspect ratio over 8 (checked on the image as given);
2. if w*h > 1024^2: Lanczos-resize, in the image's own mode, to (int(w*s), int(h*s)), s = sqrt(1024^2 / (w*h));
3. floor both sides to a multiple of the pixels per token (vae_scale_factor x 2: 16 for the klein models);
4. `preprocess(..., resize_mode="crop")`: `Flux2ImageProcessor` overrides `_resize_and_crop` with a plain
   centre crop (offsets (w - W) // 2, (h - H) // 2), so no second resample happens;
5. convert to RGB (after the crop), uint8 / 255 in float32, then 2x - 1.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.limits import LIMITS, check_file_size, check_reference_pixels
from flux2klein_cli.core.paths import check_input_file

# A reference as the caller names it: a file, or (label, bytes) of an upload (`serve`: a request never
# names a server-side path).
ReferenceSource = Path | tuple[str, bytes]

MIN_SIDE = 64
MAX_ASPECT = 8
MAX_AREA = DEFAULTS.reference_max_area
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


@contextmanager
def _own_size_limit() -> Iterator[None]:
    """Pillow's decompression-bomb checks off (its warning is three raw lines): `load_reference` applies
    the limits table's `reference_pixels` itself, one bound of our own, from the header, before any
    pixel is decoded."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _to_eight_bit(image: Image.Image, name: str) -> Image.Image:
    """A grayscale image of more than 8 bits as 8-bit "L" by its real range: 16-bit (and 32-bit
    integer) values scaled 65535 -> 255, float values in [0, 1] scaled 1 -> 255. Pillow's own
    convert("RGB") clips them to 0..255 instead, so a 16-bit image turns white and a float one black."""
    if image.mode not in (*_SIXTEEN_BIT, "I", "F"):
        return image
    values = np.asarray(image)
    if image.mode == "F":
        finite = bool(np.isfinite(values).all())
        low, high = (float(values.min()), float(values.max())) if finite and values.size else (0.0, 0.0)
        if not finite or low < 0.0 or high > 1.0:
            shown = "NaN or infinite values" if not finite else f"values from {low:g} to {high:g}"
            raise UserInputError(f"{name} holds floating-point pixels with {shown}; only values in [0, 1] "
                                 "can be read as an image: scale it to [0, 1] or save it as 8- or 16-bit")
        scaled = np.rint(values.astype(np.float64) * 255.0)
    else:
        low, high = int(values.min()), int(values.max())
        if low < 0 or high > 65535:
            raise UserInputError(f"{name} holds 32-bit integer pixels from {low} to {high}; only 8- and 16-bit "
                                 "images (0..65535) can be read: save it as 8- or 16-bit")
        scaled = np.rint(values.astype(np.float64) * (255.0 / 65535.0))
    return Image.fromarray(scaled.astype(np.uint8), "L")


def load_reference(path: str | os.PathLike[str], data: bytes | None = None, *, keep_alpha: bool = False
                   ) -> Image.Image:
    """Open a reference image fully (so a truncated file fails here), upright per EXIF, as RGB,
    checked for size and aspect (`check_reference`) under its file name.

    With `data`, the image is those bytes (an upload: `serve`) and `path` only names it; the same
    checks apply (bytes bounded as a file's, pixels from the header before decoding).

    For 8-bit images this is what `diffusers.utils.load_image(path)` returns, so both pipelines see
    the same pixels; deeper grayscale (16-bit, float) is scaled by its range (`_to_eight_bit`).
    `keep_alpha`: an image with an alpha channel (or a palette's transparency) comes back RGBA
    (a mask read by OpenAI's rule, conditioning.mask_levels).
    """
    p = Path(path)
    name = f"reference image {p}"
    if data is None:
        check_input_file(p, "reference image", "an image file")
        check_file_size(p, LIMITS.reference_bytes, "reference image")
    elif len(data) > LIMITS.reference_bytes:
        raise UserInputError(f"{name} is {len(data)} bytes; the limit is {LIMITS.reference_bytes} bytes")
    try:
        with _own_size_limit(), Image.open(p if data is None else io.BytesIO(data)) as opened:
            check_reference_pixels(name, *opened.size)
            opened.load()
            upright = _to_eight_bit(ImageOps.exif_transpose(opened), name)
            alpha = "A" in upright.getbands() or (upright.mode == "P" and "transparency" in upright.info)
            rgb = upright.convert("RGBA" if keep_alpha and alpha else "RGB")
    except PermissionError:
        raise UserInputError(f"cannot read reference image {p}: permission denied") from None
    except UnidentifiedImageError:
        raise UserInputError(f"reference image {p} is not an image file (or not a format Pillow reads)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        # Truncated or corrupt data, unsupported pixel modes, absurd dimensions.
        raise UserInputError(f"cannot read reference image {p}: {_one_line(e)}") from None
    check_reference(rgb, name)
    return rgb


def read_reference(source: ReferenceSource, *, keep_alpha: bool = False) -> tuple[str, Image.Image]:
    """(name, image) of a reference, read by `load_reference`. An upload's name carries a digest of
    its bytes: names are part of a plan's batch key, so two uploads called image.png must not pass
    for one reference. `keep_alpha`: RGBA when the image has transparency."""
    if isinstance(source, tuple):
        import hashlib

        label, data = source
        return (f"{label}@sha256:{hashlib.sha256(data).hexdigest()[:16]}",
                load_reference(label, data, keep_alpha=keep_alpha))
    return str(source), load_reference(source, keep_alpha=keep_alpha)


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


def _area_capped_size(width: int, height: int, max_area: int = MAX_AREA) -> tuple[int, int]:
    if width * height <= max_area:
        return width, height
    # Same float expression and truncation as diffusers, so the sizes agree to the pixel.
    scale = math.sqrt(max_area / (width * height))
    return int(width * scale), int(height * scale)


def preprocess_reference(
    image: Image.Image, name: str = "reference image", *, multiple_of: int, max_area: int = MAX_AREA
) -> np.ndarray:
    """One reference image as diffusers feeds it to the VAE: (H, W, 3) float32 in [-1, 1], cropped
    to a multiple of the model's pixels per token (`multiple_of`, LatentGeometry); larger than
    `max_area` pixels, scaled down to it first (diffusers' rule, its 1024 x 1024 by default)."""
    check_reference(image, name)
    capped = _area_capped_size(*image.size, max_area)
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
