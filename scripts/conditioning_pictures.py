"""The pictures of docs/cli.md's image-to-image and inpainting section, from synthetic images and
flux2klein's own preprocessing (no model: the tiny model's images are noise). Run from the repo root:

    python scripts/conditioning_pictures.py   # writes docs/images/conditioning-*.png
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from flux2klein_cli.core.inputs import conditioning
from flux2klein_cli.core.inputs.images import preprocess_reference
from flux2klein_cli.core.pipeline.pixels import postprocess
from flux2klein_cli.core.pipeline.schedule import SchedulerConfig, make_schedule, start_step

OUT = Path("docs/images")
W, H, P = 192, 128, 16  # picture size, pixels per token


def room() -> Image.Image:
    """A synthetic 'room': a wall gradient, a floor, a window and a box to repaint."""
    y, x = np.mgrid[0:H, 0:W].astype(np.float32)
    wall = np.stack([200 - y * 0.3, 190 - y * 0.2, 170 + x * 0.1], -1)
    floor = np.stack([120 + x * 0.1, 90 + 0 * x, 60 + 0 * x], -1)
    pixels = np.where((y > 88)[..., None], floor, wall)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    draw.rectangle((16, 16, 64, 64), fill=(150, 200, 240), outline=(90, 70, 50), width=3)  # window
    draw.rectangle((100, 60, 150, 100), fill=(60, 110, 60))  # the box the mask covers
    return image


def mask() -> Image.Image:
    pixels = np.zeros((H, W), np.uint8)
    pixels[56:104, 88:152] = 255  # edges between two tokens' bilinear samples: those tokens get 0.5
    return Image.fromarray(pixels, "L")


def token_mask(mask_image: Image.Image) -> Image.Image:
    """The mask on the token grid (what the blend uses), drawn one gray block per token."""
    binary = conditioning.preprocess_mask(mask_image, mask_image.size, multiple_of=P)
    grid = conditioning.mask_to_grid(binary, (H // P, W // P))
    return Image.fromarray((grid * 255).round().astype(np.uint8), "L").resize((W, H), Image.Resampling.NEAREST)


def kept(init: Image.Image, mask_image: Image.Image) -> Image.Image:
    """The init image where the mask keeps it, a checkerboard where the model repaints."""
    y, x = np.mgrid[0:H, 0:W]
    checker = np.where(((x // 8 + y // 8) % 2 == 0)[..., None], 235, 180).repeat(3, -1).astype(np.uint8)
    keep = (np.asarray(mask_image) < 128)[..., None]
    return Image.fromarray(np.where(keep, np.asarray(init), checker))


def start(init: Image.Image, strength: float, steps: int = 10) -> Image.Image:
    """Where the loop starts at this strength, shown in pixel space: the init image mixed with
    noise at the start step's sigma (the model mixes latents the same way)."""
    schedule = make_schedule(steps, (H // P) * (W // P), SchedulerConfig())
    sigma = float(schedule.sigmas[start_step(steps, strength)])
    print(f"strength {strength}, {steps} steps: starts at step {start_step(steps, strength)}, sigma {sigma:.3f}")
    pixels = conditioning.preprocess_init_image(init, multiple_of=P)
    noise = np.random.default_rng(0).normal(0, 1, pixels.shape).astype(np.float32)
    return Image.fromarray(postprocess((sigma * noise + (1 - sigma) * pixels)[None])[0])


def padding_crop(init: Image.Image, mask_image: Image.Image, pad: int = 16) -> list[tuple[str, Image.Image]]:
    """--padding-mask-crop: the box on the init image, and the box's pixels scaled up to the output
    size, which is what the model denoises (then scaled back into the box)."""
    box = conditioning.crop_box(mask_image, W, H, pad)
    framed = init.copy()
    ImageDraw.Draw(framed).rectangle(box, outline=(220, 30, 30), width=2)
    denoised = init.crop(box).resize((W, H), Image.Resampling.LANCZOS)
    return [(f"crop-box-{pad}", framed), (f"crop-denoised-{pad}", denoised)]


def reference_sizes() -> list[tuple[str, Image.Image]]:
    """A 400x300 reference as the transformer sees it at the default and a smaller max area."""
    y, x = np.mgrid[0:300, 0:400]
    stripes = np.stack([(x * 0.6) % 255, (y * 0.8) % 255, np.full_like(x, 140)], -1).astype(np.uint8)
    source = Image.fromarray(stripes)
    out = [("reference-400x300", source)]
    for area in (1024 * 1024, 128 * 128):
        pixels = preprocess_reference(source, multiple_of=P, max_area=area)
        out.append((f"reference-area-{area}", Image.fromarray(postprocess(pixels[None])[0])))
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    init, m = room(), mask()
    pictures = [("init", init), ("mask", m), ("mask-tokens", token_mask(m)), ("kept", kept(init, m))]
    pictures += [(f"start-strength-{s}", start(init, s)) for s in (0.1, 0.3, 0.6)]
    pictures += padding_crop(init, m)
    pictures += reference_sizes()
    for name, image in pictures:
        image.save(OUT / f"conditioning-{name}.png", optimize=True)
        print(OUT / f"conditioning-{name}.png", image.size)


if __name__ == "__main__":
    main()
