"""End-to-end parity with diffusers' Flux2KleinPipeline: same checkpoint, prompts and initial noise."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.engine.engine import Engine
from flux2klein_cli.core.engine.plan import RunFields
from flux2klein_cli.core.runs.parity import ParityRun, reference_pipeline, run_parity, run_reference
from tests.fixtures.engine import engine_on, upload

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

MIN_SSIM, MAX_DIFF = 0.999, 2  # max pixel difference in 1/255 steps
BF16_FACTOR = 2.0  # our bf16 error over diffusers' bf16 error, both against diffusers' fp32


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Engine:
    return engine_on(tiny_checkpoint)


def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """Smooth gradients plus noise: structure for the VAE to encode, different per seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], -1) * 200
    pixels = np.clip(base + rng.normal(0, 25, (height, width, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def check(engine: Engine, fields: RunFields, references: list[Image.Image] = ()) -> ParityRun:
    """`fields` (with `references` as uploads) through the engine and diffusers: the same images."""
    sources = tuple(upload(image, f"reference-{i}.png") for i, image in enumerate(references))
    run = run_parity(engine, replace(fields, references=sources), "fp32")
    assert run.ours.shape == run.reference.shape
    assert run.metrics.ssim >= MIN_SSIM, run.metrics
    assert run.metrics.max_diff <= MAX_DIFF, run.metrics
    # The images are not trivially equal (e.g. all black): random weights still give structure.
    assert run.reference.std() > 10
    return run


@pytest.mark.parametrize("height, width", [(64, 64), (48, 96)], ids=["square", "non-square"])
def test_text_to_image(engine: Engine, height: int, width: int) -> None:
    check(engine, RunFields(prompts=("a red fox in snow",), steps=4, height=height, width=width, seed=3))


@pytest.mark.slow
def test_batch_of_two_prompts_with_two_images_each(engine: Engine) -> None:
    check(engine, RunFields(prompts=("a red fox in snow", "a lighthouse at dawn, oil painting"), num_images=2, steps=3,
                            height=64, width=64, seed=11))


def test_edit_with_one_reference(engine: Engine) -> None:
    # Output size comes from the (processed) reference: 100x75 -> 96x64.
    run = check(engine, RunFields(prompts=("make it blue",), steps=4, seed=5), [synthetic_image(100, 75, 0)])
    assert (run.plan.height, run.plan.width) == (64, 96)


@pytest.mark.slow
def test_edit_with_three_references_of_different_sizes(engine: Engine) -> None:
    references = [synthetic_image(96, 64, 1), synthetic_image(70, 140, 2), synthetic_image(200, 64, 3)]
    check(engine, RunFields(prompts=("put them together",), steps=3, height=64, width=80, seed=7), references)


def test_base_model_with_guidance_and_negative_prompt(tiny_base_checkpoint: Path) -> None:
    run = check(engine_on(tiny_base_checkpoint), RunFields(
        prompts=("a red fox in snow",), negative_prompt="blurry, low quality", steps=4, guidance=4.0, height=64,
        width=64, seed=1))
    assert run.plan.cfg


@pytest.mark.slow
def test_narrow_decoder_model(tiny_small_decoder_checkpoint: Path) -> None:
    """A VAE whose decoder is narrower than its encoder (like FLUX.2-small-decoder), text to image and edit."""
    small = engine_on(tiny_small_decoder_checkpoint)
    config = small.pipeline.models.vae.config
    assert config.decoder_block_out_channels != config.block_out_channels
    check(small, RunFields(prompts=("a red fox in snow",), steps=3, height=64, width=48, seed=2),
          [synthetic_image(64, 64, 4)])


@pytest.mark.slow
def test_bf16_is_as_close_to_fp32_as_diffusers_own_bf16(tiny_checkpoint: Path) -> None:
    """Our bf16 run against diffusers' fp32 errs about as much as diffusers' bf16 run does: a
    bf16-only mistake (a cast in the wrong place, an fp32 step skipped) would show as more."""
    ours = engine_on(tiny_checkpoint, dtype="bf16")
    plan = ours.plan(RunFields(prompts=("a red fox in snow",), steps=4, height=64, width=64, seed=3))
    noise = ours.initial_noise(plan)
    mine = ours.run(plan).images
    fp32, bf16 = (run_reference(reference_pipeline(ours, dtype), plan, noise, []) for dtype in ("fp32", "bf16"))

    def error(images: np.ndarray) -> float:  # mean absolute difference from fp32, in 1/255 steps
        return float(np.abs(images.astype(np.float32) - fp32.astype(np.float32)).mean())

    assert fp32.std() > 10 and error(bf16) > 0  # bf16 differs from fp32 at all: the comparison means something
    assert error(mine) <= BF16_FACTOR * error(bf16), (error(mine), error(bf16))
