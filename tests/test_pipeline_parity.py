"""End-to-end parity with diffusers' Flux2KleinPipeline: same checkpoint, prompts and initial noise."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.images import preprocess_reference
from flux2klein_cli.core.parity import run_parity
from flux2klein_cli.core.pipeline.pipeline import KleinPipeline, Request

MIN_SSIM, MAX_DIFF = 0.999, 2  # max pixel difference in 1/255 steps


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint: Path) -> KleinPipeline:
    return KleinPipeline.load(tiny_checkpoint, dtype=jnp.float32)


def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """Smooth gradients plus noise: structure for the VAE to encode, different per seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], -1) * 200
    pixels = np.clip(base + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def check(pipeline: KleinPipeline, request: Request, references: list[Image.Image] = ()) -> None:
    multiple = pipeline.geometry.pixels_per_token
    request.references = [preprocess_reference(image, multiple_of=multiple) for image in references]
    run = run_parity(pipeline, request, list(references), "fp32")
    assert run.ours.shape == run.reference.shape
    assert run.metrics.ssim >= MIN_SSIM, run.metrics
    assert run.metrics.max_diff <= MAX_DIFF, run.metrics
    # The images are not trivially equal (e.g. all black): random weights still give structure.
    assert run.reference.std() > 10


@pytest.mark.parametrize("height, width", [(64, 64), (48, 96)], ids=["square", "non-square"])
def test_text_to_image(pipeline: KleinPipeline, height: int, width: int) -> None:
    check(pipeline, Request(prompts=["a red fox in snow"], steps=4, guidance=1.0, height=height, width=width, seed=3))


def test_batch_of_two_prompts_with_two_images_each(pipeline: KleinPipeline) -> None:
    request = Request(prompts=["a red fox in snow", "a lighthouse at dawn, oil painting"], num_images=2, steps=3,
                      guidance=1.0, height=64, width=64, seed=11)
    check(pipeline, request)


def test_edit_with_one_reference(pipeline: KleinPipeline) -> None:
    # Output size comes from the (processed) reference: 100x75 -> 96x64.
    check(pipeline, Request(prompts=["make it blue"], steps=4, guidance=1.0, seed=5), [synthetic_image(100, 75, 0)])


def test_edit_with_three_references_of_different_sizes(pipeline: KleinPipeline) -> None:
    references = [synthetic_image(96, 64, 1), synthetic_image(70, 140, 2), synthetic_image(200, 64, 3)]
    check(pipeline, Request(prompts=["put them together"], steps=3, guidance=1.0, height=64, width=80, seed=7),
          references)


def test_base_model_with_guidance_and_negative_prompt(tiny_base_checkpoint: Path) -> None:
    base = KleinPipeline.load(tiny_base_checkpoint, dtype=jnp.float32)
    request = Request(prompts=["a red fox in snow"], negative_prompt="blurry, low quality", steps=4, guidance=4.0,
                      height=64, width=64, seed=1)
    assert base.uses_guidance(request.guidance)
    check(base, request)


def test_narrow_decoder_model(tiny_small_decoder_checkpoint: Path) -> None:
    """A VAE whose decoder is narrower than its encoder (like FLUX.2-small-decoder), text to image and edit."""
    small = KleinPipeline.load(tiny_small_decoder_checkpoint, dtype=jnp.float32)
    assert small.models.vae.config.decoder_block_out_channels != small.models.vae.config.block_out_channels
    check(small, Request(prompts=["a red fox in snow"], steps=3, guidance=1.0, height=64, width=48, seed=2),
          [synthetic_image(64, 64, 4)])
