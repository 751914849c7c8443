"""Image-to-image and inpainting against diffusers' Flux2KleinInpaintPipeline: same checkpoint,
prompt, init image, mask and noise (torch's draw from the seed, which that pipeline mixes with
the init image itself)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.engine.engine import Engine
from flux2klein_cli.core.engine.plan import RunFields
from flux2klein_cli.core.inputs import conditioning
from flux2klein_cli.core.pipeline.pixels import postprocess
from flux2klein_cli.core.pipeline.schedule import start_step
from tests.fixtures.engine import engine_on, upload
from tests.test_pipeline_parity import check, synthetic_image

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Engine:
    return engine_on(tiny_checkpoint)


def box_mask(width: int, height: int, box: tuple[int, int, int, int]) -> Image.Image:
    """White (repaint) inside `box` (left, top, right, bottom), black elsewhere; an edge off the
    16 px grid, so some tokens get a fractional mask."""
    pixels = np.zeros((height, width), np.uint8)
    left, top, right, bottom = box
    pixels[top:bottom, left:right] = 255
    return Image.fromarray(pixels, "L")


def run(engine: Engine, fields: RunFields, init: Image.Image, mask: Image.Image | None,
        references: list[Image.Image] = ()) -> np.ndarray:
    """`fields` with `init` (and `mask`) through the engine and diffusers' inpaint pipeline: the same images."""
    masked = replace(fields, init_image=upload(init, "init.png"),
                     mask=None if mask is None else upload(mask, "mask.png"))
    return check(engine, masked, references).ours


def test_inpaint_matches_diffusers(engine: Engine) -> None:
    init, mask = synthetic_image(96, 64, 10), box_mask(96, 64, (24, 8, 72, 40))
    ours = run(engine, RunFields(prompts=("a red ball",), steps=4, seed=3, strength=0.6), init, mask)
    # The kept part is the init image's own latents at the end: near the init image there.
    kept = postprocess(conditioning.preprocess_init_image(init, multiple_of=16)[None])[0]
    far = np.zeros((64, 96), bool)
    far[48:, :] = True  # rows of tokens the mask's bilinear footprint never reaches
    inside = np.zeros((64, 96), bool)
    inside[16:32, 32:64] = True
    error = np.abs(ours[0].astype(np.int16) - kept.astype(np.int16))
    assert error[far].mean() < error[inside].mean()


def test_inpaint_with_a_reference_image(engine: Engine) -> None:
    init, mask = synthetic_image(64, 64, 11), box_mask(64, 64, (8, 8, 40, 56))
    run(engine, RunFields(prompts=("put the cat here",), steps=3, seed=5, strength=1.0), init, mask,
        [synthetic_image(100, 75, 12)])


def test_image_to_image_is_the_inpaint_pipeline_with_an_all_white_mask(engine: Engine) -> None:
    # 8 steps at strength 0.5: the loop runs the last 4, from the init latents noised to sigma 4.
    assert start_step(8, 0.5) == 4
    run(engine, RunFields(prompts=("make it night",), steps=8, seed=7, strength=0.5), synthetic_image(80, 64, 13), None)


@pytest.mark.slow
def test_inpaint_of_two_images_per_prompt_on_the_base_model(tiny_base_checkpoint: Path) -> None:
    init, mask = synthetic_image(64, 64, 14), box_mask(64, 64, (0, 0, 40, 30))
    run(engine_on(tiny_base_checkpoint), RunFields(prompts=("a lighthouse",), negative_prompt="blurry", num_images=2,
                                                   steps=4, guidance=3.0, seed=9, strength=0.75), init, mask)


def test_mask_preprocessing_matches_diffusers() -> None:
    """Binarised at 0.5 and brought to the token grid bilinearly, as the mask processor and
    prepare_mask_latents do (a gray ramp crosses the threshold mid-image)."""
    import torch
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    ramp = np.tile(np.linspace(0, 255, 80).round().astype(np.uint8), (48, 1))
    mask = Image.fromarray(ramp, "L")
    processor = Flux2ImageProcessor(vae_scale_factor=16, vae_latent_channels=32, do_normalize=False,
                                    do_binarize=True, do_convert_rgb=False, do_convert_grayscale=True)
    theirs = processor.preprocess(mask, height=48, width=80)
    theirs_grid = torch.nn.functional.interpolate(theirs, size=(3, 5), mode="bilinear")[0, 0].numpy()
    ours = conditioning.preprocess_mask(mask, (80, 48), multiple_of=16)
    np.testing.assert_array_equal(ours, theirs[0, 0].numpy())
    np.testing.assert_array_equal(conditioning.mask_to_grid(ours, (3, 5)), theirs_grid)
    assert 0 < theirs_grid.mean() < 1


def test_a_large_init_image_is_sized_as_diffusers_sizes_it() -> None:
    # 1300 x 1000 > 1024^2: scaled to 1167 x 897, then floored to multiples of 16.
    assert conditioning.init_image_size(1300, 1000, multiple_of=16) == (1152, 896)
    assert conditioning.init_image_size(640, 480, multiple_of=16) == (640, 480)
