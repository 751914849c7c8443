"""The init image and the mask of image-to-image and inpainting, prepared as diffusers'
`Flux2KleinInpaintPipeline` (0.42) prepares them.

Init image (`image=`): when its area exceeds 1024 x 1024 it is Lanczos-scaled by sqrt(1024^2 / area)
(sides truncated), then Lanczos-resized to sides floored to the model's multiple; below that area
a size that is not a multiple is refused here (diffusers would resample it silently). RGB, /255,
2x - 1: the output takes its size.

Mask (`mask_image=`): the same size as the init image as given; resized like it when the init
image was (Lanczos, in grayscale), then binarised (value / 255 < 0.5 -> 0 keep, else 1 repaint),
and brought to the latent grid by bilinear interpolation as torch's `interpolate(mode="bilinear")`
with `align_corners=False` computes it, so a token on the mask's edge gets a fraction. A mask read
by `serve` may say it in transparency instead (OpenAI's Images API): see `mask_levels`.

Padding mask crop (`padding_mask_crop=`): the box around the mask's nonzero pixels, grown by the
padding and then to the output's aspect (`crop_box`, diffusers' `get_crop_region`); the init image
and the mask cropped to it and resized to the output size keeping the aspect, edges stretched into
any gap (`_fill`, diffusers' resize mode "fill"). After decoding, the pipeline pastes the image
back into the box (core/pipeline/pixels.py: `paste_back`).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from flux2klein_cli.core.errors import FieldError

MAX_INIT_AREA = 1024 * 1024  # diffusers' inpaint pipeline caps the init image at this area, always
BINARY_THRESHOLD = 0.5


def init_image_size(width: int, height: int, *, multiple_of: int) -> tuple[int, int]:
    """(width, height) of the output for an init image of this size, as diffusers sizes it; a size
    under the area cap that is not a multiple is a FieldError."""
    if width * height <= MAX_INIT_AREA:
        if width % multiple_of or height % multiple_of:
            def near(side: int) -> str:
                low = side - side % multiple_of
                return f"{low} or {low + multiple_of}" if low else str(multiple_of)

            raise FieldError("init_image", f"is {width}x{height}; both sides must be multiples of {multiple_of} "
                             f"(width {near(width)}, height {near(height)}): crop or resize it")
        return width, height
    scaled = _scaled(width, height)
    return (scaled[0] // multiple_of) * multiple_of, (scaled[1] // multiple_of) * multiple_of


def _scaled(width: int, height: int) -> tuple[int, int]:
    scale = math.sqrt(MAX_INIT_AREA / (width * height))  # diffusers' expression, height and width alike
    return int(width * scale), int(height * scale)


def _resized(image: Image.Image, *, multiple_of: int) -> Image.Image:
    """The image at the output size: unchanged, or scaled down and resized as diffusers does."""
    target = init_image_size(*image.size, multiple_of=multiple_of)
    if target == image.size:
        return image
    image = image.resize(_scaled(*image.size), Image.Resampling.LANCZOS)
    return image if image.size == target else image.resize(target, Image.Resampling.LANCZOS)


def preprocess_init_image(image: Image.Image, *, multiple_of: int,
                          box: tuple[int, int, int, int] | None = None) -> np.ndarray:
    """The init image as the VAE takes it: (H, W, 3) float32 in [-1, 1] at the output size; with a
    padding mask crop's `box`, that part of it filled out to the output size."""
    sized = _resized(image, multiple_of=multiple_of)
    if box is not None:
        sized = _fill(sized.crop(box), *sized.size)
    pixels = np.asarray(sized.convert("RGB")).astype(np.float32) / 255.0
    return 2.0 * pixels - 1.0


def mask_levels(mask: Image.Image, *, alpha: bool = False) -> Image.Image:
    """The mask as one channel "L", white = repaint. With `alpha` (serve's uploads, OpenAI's rule), a
    mask with an alpha channel that is transparent anywhere says it in transparency: repaint is
    255 - alpha (fully transparent: repaint, opaque: keep); an opaque one is read by its gray levels."""
    if alpha and ("A" in mask.getbands() or (mask.mode == "P" and "transparency" in mask.info)):
        opacity = np.asarray(mask.convert("RGBA"))[..., 3]
        if (opacity < 255).any():
            return Image.fromarray((255 - opacity).astype(np.uint8), "L")
    return check_grayscale(mask)


def check_grayscale(mask: Image.Image) -> Image.Image:
    """The mask as one channel "L"; colour (channels that differ anywhere) is a FieldError: which
    channel would mean "repaint" is a guess, so the mask must say it in gray levels."""
    if mask.mode in ("L", "1"):
        return mask.convert("L")
    rgb = np.asarray(mask.convert("RGB"))
    if not (np.array_equal(rgb[..., 0], rgb[..., 1]) and np.array_equal(rgb[..., 1], rgb[..., 2])):
        raise FieldError("mask", "is not grayscale: its red, green and blue differ; white marks what to repaint, "
                         "black what to keep (save it as a grayscale image)")
    return Image.fromarray(rgb[..., 0], "L")


def check_mask_size(mask: Image.Image, init_size: tuple[int, int]) -> None:
    if mask.size != init_size:
        raise FieldError("mask", f"is {mask.size[0]}x{mask.size[1]} but the init image ({{field:init_image}}) is "
                         f"{init_size[0]}x{init_size[1]}: they must be the same size")


def preprocess_mask(mask: Image.Image, init_size: tuple[int, int], *, multiple_of: int, alpha: bool = False,
                    box: tuple[int, int, int, int] | None = None) -> np.ndarray:
    """The mask at pixel resolution, binarised: (H, W) float32 of 0 (keep) and 1 (repaint) at the
    output size. `init_size` is the init image's (width, height) as given: the mask must match it.
    `alpha`: see `mask_levels`; `box`: a padding mask crop's, that part filled out to the output size."""
    check_mask_size(mask, init_size)
    gray = mask_levels(mask, alpha=alpha)
    target = init_image_size(*init_size, multiple_of=multiple_of)
    if box is not None:
        gray = _fill(gray.crop(box), *target).convert("L")
    elif target != gray.size:
        gray = gray.resize(_scaled(*gray.size), Image.Resampling.LANCZOS)
        if gray.size != target:
            gray = gray.resize(target, Image.Resampling.LANCZOS)
    values = np.asarray(gray).astype(np.float32) / np.float32(255.0)
    return np.where(values < BINARY_THRESHOLD, np.float32(0), np.float32(1)).astype(np.float32)


def _bilinear_weights(size_in: int, size_out: int) -> np.ndarray:
    """(size_out, size_in) float32 weights of torch's bilinear resampling along one axis
    (align_corners=False, no antialiasing: each output samples its two nearest inputs)."""
    scale = np.float32(size_in / size_out)
    out = np.zeros((size_out, size_in), np.float32)
    for i in range(size_out):
        source = max(np.float32((i + 0.5) * scale - 0.5), np.float32(0))
        low = min(int(source), size_in - 1)
        high = min(low + 1, size_in - 1)
        frac = np.float32(source - low)
        out[i, low] += np.float32(1) - frac
        out[i, high] += frac
    return out


def mask_to_grid(mask: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """A binarised (H, W) mask -> (rows, columns) float32 on the latent token grid: per token, the
    share of it to repaint as diffusers' bilinear interpolation gives it."""
    rows = _bilinear_weights(mask.shape[0], grid[0])
    cols = _bilinear_weights(mask.shape[1], grid[1])
    return (rows @ mask.astype(np.float32) @ cols.T).astype(np.float32)


# ----------------------------------------------------------------------------- padding mask crop


def check_crop_size(image: Image.Image, *, multiple_of: int) -> None:
    """A padding mask crop needs the init image at its own size: diffusers crops the init image it
    scaled down with the box of the mask it did not (and then fails pasting back)."""
    if init_image_size(*image.size, multiple_of=multiple_of) != image.size:
        raise FieldError("padding_mask_crop", f"needs an init image ({{field:init_image}}) of at most 1024x1024 "
                         f"pixels; it is {image.size[0]}x{image.size[1]}: scale it down first")


def crop_box(mask: Image.Image, width: int, height: int, pad: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) around the mask's nonzero pixels, `pad` pixels more on each side
    (within the image), then grown to the output's aspect `width / height` about its centre,
    shifted back inside the image where it runs over: diffusers' get_crop_region, step for step."""
    levels = np.asarray(mask.convert("L"))
    rows, cols = np.flatnonzero(levels.any(axis=1)), np.flatnonzero(levels.any(axis=0))
    if not rows.size:
        raise FieldError("mask", "is black everywhere: a padding mask crop ({field:padding_mask_crop}) needs "
                         "something to repaint")
    h, w = levels.shape
    x1, y1 = max(int(cols[0]) - pad, 0), max(int(rows[0]) - pad, 0)
    x2, y2 = min(int(cols[-1]) + 1 + pad, w), min(int(rows[-1]) + 1 + pad, h)
    ratio = width / height
    if (x2 - x1) / (y2 - y1) > ratio:
        y1, y2 = _grow(y1, y2, int((x2 - x1) / ratio - (y2 - y1)), h)
    else:
        x1, x2 = _grow(x1, x2, int((y2 - y1) * ratio - (x2 - x1)), w)
    return x1, y1, x2, y2


def _grow(low: int, high: int, by: int, size: int) -> tuple[int, int]:
    """[low, high) grown by `by` (half each side, the odd one at the end), moved back inside [0, size)."""
    low, high = low - by // 2, high + by - by // 2
    if high >= size:
        low, high = low - (high - size), size
    if low < 0:
        low, high = 0, high - low
    return low, min(high, size)


def _fill(image: Image.Image, width: int, height: int) -> Image.Image:
    """`image` Lanczos-resized to fit (width, height) keeping its aspect, centred on an RGB canvas,
    the gap on either side filled by its edge row or column stretched (diffusers' "fill")."""
    ratio, source = width / height, image.width / image.height
    w = width if ratio < source else image.width * height // image.height
    h = height if ratio >= source else image.height * width // image.width
    resized = image.resize((w, h), resample=Image.Resampling.LANCZOS)
    out = Image.new("RGB", (width, height))
    out.paste(resized, box=(width // 2 - w // 2, height // 2 - h // 2))
    if ratio < source:
        gap = height // 2 - h // 2
        if gap > 0:
            out.paste(resized.resize((width, gap), box=(0, 0, width, 0)), box=(0, 0))
            out.paste(resized.resize((width, gap), box=(0, resized.height, width, resized.height)), box=(0, gap + h))
    elif ratio > source:
        gap = width // 2 - w // 2
        if gap > 0:
            out.paste(resized.resize((gap, height), box=(0, 0, 0, height)), box=(0, 0))
            out.paste(resized.resize((gap, height), box=(resized.width, 0, resized.width, height)), box=(gap + w, 0))
    return out
