"""What inpainting and image-to-image guarantee with random weights, on klein's latent geometry
(the `tiny` fixture's VAE: 32 latent channels, 2x2 patches to 128, random batch-norm statistics,
16 px per token), run through the engine and measured against diffusers' Flux2KleinInpaintPipeline
on the same files and noise.

Outside the mask the final latents are the init image's own; the decoder's 3x3 convolutions still
spread the repainted tokens' change into their neighbours, fading with distance (diffusers' figures
in docs/cli.md), so the far side of "far" is two tokens (32 px) from the mask, not one.
At a low strength the seed still matters as much as at full strength: klein's 4-step schedule,
shifted for small images, runs strength 0.1 as its last step from sigma 0.70 (70 % noise), and a
random transformer's velocity does not remove that noise (a trained one does). What a correct
pipeline guarantees there is diffusers' start step, sigma and blend: checked image for image.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.engine.engine import Engine, EngineOptions
from flux2klein_cli.core.engine.plan import RunFields
from flux2klein_cli.core.runs.parity import torch_noise
from tests.test_pipeline_parity import MAX_DIFF, synthetic_image

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

WIDTH, HEIGHT, STEPS, SEED, PROMPT = 128, 96, 4, 21, "a red ball on a table"
BOX = (36, 28, 84, 60)  # the mask's white box (left, top, right, bottom): 48x32, edges off the 16 px grid


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The init image, the mask and two images' noise (diffusers' draw from SEED, which its inpaint
    pipeline mixes with the init latents; ours takes it as `latents`)."""
    root = tmp_path_factory.mktemp("inpaint-geometry")
    synthetic_image(WIDTH, HEIGHT, 31).save(root / "init.png")
    mask = np.zeros((HEIGHT, WIDTH), np.uint8)
    left, top, right, bottom = BOX
    mask[top:bottom, left:right] = 255
    Image.fromarray(mask, "L").save(root / "mask.png")
    np.save(root / "noise.npy", torch_noise((2, 128, HEIGHT // 16, WIDTH // 16), SEED))
    return root


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path, folder: Path) -> Engine:
    # Stored, so the second run shape compiles only its own denoise loop.
    options = EngineOptions(model=str(tiny_checkpoint), dtype="fp32", compile_cache=folder / "store")
    return Engine.load(options, tiny_checkpoint, warn=lambda message: None)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> object:
    import torch
    from diffusers import Flux2KleinInpaintPipeline

    pipe = Flux2KleinInpaintPipeline.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_both(engine: Engine, reference: object, folder: Path, strength: float, masked: bool
             ) -> tuple[np.ndarray, np.ndarray]:
    """The two noises' images, ours and diffusers' ((2, H, W, 3) int each), checked pixel for pixel."""
    import torch

    plan = engine.plan(RunFields(prompts=(PROMPT,), steps=STEPS, num_images=2, latents=folder / "noise.npy",
                                 init_image=folder / "init.png", mask=folder / "mask.png" if masked else None,
                                 strength=strength))
    ours = engine.run(plan).images.astype(int)
    init = Image.open(folder / "init.png").convert("RGB")
    mask = Image.open(folder / "mask.png") if masked else Image.new("L", init.size, 255)
    images = reference(prompt=PROMPT, image=init, mask_image=mask, strength=strength,  # type: ignore[operator]
                       num_inference_steps=STEPS, num_images_per_prompt=2, guidance_scale=1.0,
                       generator=torch.Generator().manual_seed(SEED), output_type="pil").images
    theirs = np.stack([np.asarray(image.convert("RGB")) for image in images]).astype(int)
    assert np.abs(ours - theirs).max() <= MAX_DIFF, (strength, masked, np.abs(ours - theirs).max())
    assert theirs.std() > 10
    return ours, theirs


def seed_change(images: np.ndarray, where: np.ndarray) -> float:
    """Mean absolute difference (0-255) between the two noises' images over the pixels `where`."""
    return float(np.abs(images[0] - images[1]).mean(-1)[where].mean())


def test_inpainting_moves_pixels_two_tokens_from_the_mask_ten_times_less_than_inside(
        engine: Engine, reference: object, folder: Path) -> None:
    ours, theirs = run_both(engine, reference, folder, 0.9, masked=True)
    left, top, right, bottom = BOX
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    # Pixels from the mask (0 inside it), the larger of the two axes' distances.
    distance = np.maximum(np.maximum(left - x, x - (right - 1)), np.maximum(top - y, y - (bottom - 1))).clip(0)
    inside, near, next_token, far = distance == 0, (0 < distance) & (distance <= 16), \
        (16 < distance) & (distance <= 32), distance > 32
    for images in (ours, theirs):
        changes = [seed_change(images, where) for where in (inside, near, next_token, far)]
        assert changes[0] > 20, changes
        assert changes[0] > changes[1] > changes[2] > changes[3], changes  # fading with distance
        assert changes[3] < changes[0] / 10, changes
    for where in (next_token, far):  # the decoder's spread is diffusers' own
        assert abs(seed_change(ours, where) - seed_change(theirs, where)) < 0.5


def test_low_strength_runs_diffusers_last_step(engine: Engine, reference: object, folder: Path) -> None:
    """Strength 0.1 on 4 steps: one step from the init latents noised to sigma 0.70, as diffusers
    runs it (a loop from another step or sigma would give other images)."""
    run_both(engine, reference, folder, 0.1, masked=False)


def final_latents(engine: Engine, folder: Path, strength: float, steps: int) -> np.ndarray:
    """Our two noises' final latents (2, h, w, C): the last chunk of the loop run a step a call."""
    plan = engine.plan(RunFields(prompts=(PROMPT,), steps=steps, num_images=2, latents=folder / "noise.npy",
                                 init_image=folder / "init.png", strength=strength))
    chunks: list = []
    engine.run_batch([plan], steps_per_call=1, on_chunk=chunks.append)
    assert chunks[-1].done == chunks[-1].steps
    return np.asarray(chunks[-1].latents)


def test_the_seed_matters_less_as_the_strength_falls(engine: Engine, folder: Path) -> None:
    """Over 20 steps strength 0.1 starts from sigma 0.41, 0.5 from 0.86, 1.0 from pure noise: the
    two noises' final latents differ less the lower the strength, at 0.1 by well under full
    strength's (the noise left in them is the start sigma's share). The images do not show it with
    random weights: the random decoder turns any latent difference into about 41 levels of
    difference (0.1, 0.5 and 1.0 alike, ours and diffusers'); the tests above hold the start step,
    sigma and blend to diffusers'."""
    changes = []
    for strength in (0.1, 0.5, 1.0):
        latents = final_latents(engine, folder, strength, 20)
        changes.append(float(np.abs(latents[0] - latents[1]).mean()))
    assert changes[0] < changes[1] < changes[2], changes
    assert changes[0] < 0.6 * changes[2], changes
