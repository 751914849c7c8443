"""Reference preprocessing and output postprocessing, bit for bit against diffusers' Flux2KleinPipeline."""

from __future__ import annotations

import io
from pathlib import Path
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.inputs.images import (
    check_reference,
    load_reference,
    preprocess_reference,
)
from flux2klein_cli.core.pipeline.pixels import postprocess
from tests.fixtures.reference import lazy

# torch and diffusers on first use: the module collects on a base install (no torch).
torch = lazy("torch")
diffusers = lazy("diffusers")
diffusers_images = lazy("diffusers.image_processor")
flux2_images = lazy("diffusers.pipelines.flux2.image_processor")
diffusers_utils = lazy("diffusers.utils")


class _Captured(Exception):
    pass


def diffusers_condition_images(images: list[Image.Image]) -> tuple[list[np.ndarray], int, int]:
    """Run the pipeline's own `__call__` up to the VAE encode of the references and capture its inputs.

    Everything but the image processor is a mock, so this is diffusers' real reference path, not a copy of it.
    """
    pipe = mock.MagicMock()
    pipe.vae_scale_factor = 8  # 2 ** (len(block_out_channels) - 1) for the real and the tiny VAE
    pipe.image_processor = flux2_images.Flux2ImageProcessor(vae_scale_factor=16)
    pipe.default_sample_size = 128
    pipe.do_classifier_free_guidance = False
    pipe.transformer.config.in_channels = 128
    pipe.encode_prompt.return_value = (torch.zeros(1, 4, 8), torch.zeros(1, 4, 4))
    pipe.prepare_latents.return_value = (torch.zeros(1, 4, 128), torch.zeros(1, 4, 4))
    seen: dict = {}

    def capture(images, **kwargs):
        seen["images"] = images
        raise _Captured

    pipe.prepare_image_latents.side_effect = capture
    with pytest.raises(_Captured):
        diffusers.Flux2KleinPipeline.__call__(pipe, image=images, prompt_embeds=torch.zeros(1, 4, 8),
                                              guidance_scale=1.0)
    size = pipe.prepare_latents.call_args.kwargs
    arrays = [t[0].permute(1, 2, 0).numpy() for t in seen["images"]]
    return arrays, size["height"], size["width"]


def synthetic(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise, so that resampling and cropping offsets both show in the pixels."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    noisy = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(noisy, "RGB")
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
        image = image.copy()
        image.putalpha(alpha)
        return image
    return image.convert(mode)


CASES = {
    "small 64x80": (64, 80, "RGB"),
    "non-square 300x170": (300, 170, "RGB"),
    "odd crop 301x171": (301, 171, "RGB"),
    "larger than 1024^2, 1300x900": (1300, 900, "RGB"),
    "just over 1024^2, 1025x1024": (1025, 1024, "RGB"),
    "exactly 1024^2": (1024, 1024, "RGB"),
    "tall 8:1, 64x512": (64, 512, "RGB"),
    "grayscale 333x200": (333, 200, "L"),
    "grayscale large 1500x1000": (1500, 1000, "L"),
    "RGBA 500x260": (500, 260, "RGBA"),
    "RGBA large 1100x1000": (1100, 1000, "RGBA"),
    "palette large 1200x1000": (1200, 1000, "P"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_preprocess_matches_diffusers_exactly(case: str) -> None:
    width, height, mode = CASES[case]
    image = synthetic(width, height, mode)
    (expected,), exp_h, exp_w = diffusers_condition_images([image])
    ours = preprocess_reference(image, multiple_of=16)
    assert ours.dtype == np.float32 and ours.shape == expected.shape
    assert np.array_equal(ours, expected)
    assert (exp_w, exp_h) == (ours.shape[1], ours.shape[0])  # the output size diffusers takes from it
    assert ours.min() >= -1.0 and ours.max() <= 1.0


def test_several_references_and_output_size_from_the_first() -> None:
    images = [synthetic(300, 170, seed=1), synthetic(1300, 900, seed=2), synthetic(96, 640, "L", seed=3)]
    expected, exp_h, exp_w = diffusers_condition_images(images)
    for image, want in zip(images, expected, strict=True):
        assert np.array_equal(preprocess_reference(image, multiple_of=16), want)
    assert (exp_w, exp_h) == (288, 160)


def test_area_resize_uses_lanczos_then_crops_without_resampling() -> None:
    # 1300x900 -> int(1300*s) x int(900*s) = 1230x852 by Lanczos, then a centre crop to 1216x848.
    image = synthetic(1300, 900)
    resized = np.asarray(image.resize((1230, 852), Image.Resampling.LANCZOS)).astype(np.float32)
    want = 2.0 * (resized[2:850, 7:1223] / 255.0) - 1.0
    assert np.array_equal(preprocess_reference(image, multiple_of=16), want)


def test_load_reference_matches_diffusers_load_image(tmp_path: Path) -> None:
    # EXIF orientation 6 (rotate 90 degrees) on an RGBA PNG: upright, alpha dropped, like load_image.
    image = synthetic(120, 90, "RGBA")
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "ref.png"
    image.save(path, exif=exif)
    ours = load_reference(path)
    assert ours.mode == "RGB" and ours.size == (90, 120)
    assert np.array_equal(np.asarray(ours), np.asarray(diffusers_utils.load_image(str(path))))


# --- bad input: each a UserInputError with one line naming the file --------------------------------------


def assert_one_line(err: pytest.ExceptionInfo[UserInputError], *fragments: str) -> None:
    message = str(err.value)
    assert "\n" not in message and err.value.exit_code == 2
    for fragment in fragments:
        assert fragment in message, message


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserInputError) as err:
        load_reference(tmp_path / "nope.png")
    assert_one_line(err, "nope.png", "does not exist")


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(UserInputError) as err:
        load_reference(tmp_path)
    assert_one_line(err, str(tmp_path), "directory")


def test_non_image_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.png"
    path.write_text("these are not pixels\n")
    with pytest.raises(UserInputError) as err:
        load_reference(path)
    assert_one_line(err, "notes.png", "not an image")


def test_truncated_image_file(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    synthetic(200, 200).save(buffer, format="PNG")
    path = tmp_path / "cut.png"
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    with pytest.raises(UserInputError) as err:
        load_reference(path)
    assert_one_line(err, "cut.png", "cannot read")


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # chmod 0 means nothing to root (CI runs as root), so the OS's refusal is simulated at open().
    path = tmp_path / "secret.png"
    synthetic(80, 80).save(path)
    real_open = Image.open

    def refuse(fp, *args, **kwargs):
        if Path(fp) == path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", refuse)
    with pytest.raises(UserInputError) as err:
        load_reference(path)
    assert_one_line(err, "secret.png", "permission denied")


@pytest.mark.parametrize("size", [(63, 200), (200, 63), (10, 10)])
def test_side_under_64(size: tuple[int, int]) -> None:
    with pytest.raises(UserInputError) as err:
        preprocess_reference(synthetic(*size), name="ref.png", multiple_of=16)
    assert_one_line(err, "ref.png", f"{size[0]}x{size[1]}", "at least 64")


@pytest.mark.parametrize("size", [(64, 513), (1700, 200)])
def test_aspect_over_8(size: tuple[int, int]) -> None:
    with pytest.raises(UserInputError) as err:
        preprocess_reference(synthetic(*size), name="wide.png", multiple_of=16)
    assert_one_line(err, "wide.png", "aspect ratio", "at most 8:1")


@pytest.mark.parametrize("size", [(63, 64), (64, 64), (64, 512), (64, 513), (520, 65), (1600, 200), (1601, 200)])
def test_checks_accept_and_reject_what_diffusers_does(size: tuple[int, int]) -> None:
    image = Image.new("RGB", size)
    try:
        flux2_images.Flux2ImageProcessor.check_image_input(image)
        diffusers_ok = True
    except ValueError:
        diffusers_ok = False
    try:
        check_reference(image)
        ours_ok = True
    except UserInputError:
        ours_ok = False
    assert ours_ok == diffusers_ok


# --- postprocess -----------------------------------------------------------------------------------------


def diffusers_postprocess(images_bhwc: torch.Tensor) -> np.ndarray:
    processor = diffusers_images.VaeImageProcessor(vae_scale_factor=16)
    pil = processor.postprocess(images_bhwc.permute(0, 3, 1, 2), output_type="pil")
    return np.stack([np.asarray(p) for p in pil])


def test_postprocess_matches_diffusers_float32() -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(-1.3, 1.3, (2, 48, 80, 3)).astype(np.float32)
    # Values whose x*255 lands exactly on .5 exercise the rounding mode (half to even, as numpy).
    x[0, 0, :8, 0] = (2 * (np.arange(8) + 0.5) / 255 - 1).astype(np.float32)
    ours = postprocess(x)
    assert ours.dtype == np.uint8 and ours.shape == x.shape
    assert np.array_equal(ours, diffusers_postprocess(torch.from_numpy(x)))


def test_postprocess_matches_diffusers_bfloat16() -> None:
    # A bf16 VAE: diffusers denormalises and clamps in bf16 before going to float32.
    rng = np.random.default_rng(1)
    x32 = rng.uniform(-1.1, 1.1, (1, 32, 32, 3)).astype(np.float32)
    ref = torch.from_numpy(x32).to(torch.bfloat16)
    ours = postprocess(ref.float().numpy().astype(ml_dtypes.bfloat16))
    assert np.array_equal(ours, diffusers_postprocess(ref))


def test_postprocess_single_image_gets_a_batch_axis() -> None:
    assert postprocess(np.zeros((16, 16, 3), np.float32)).shape == (1, 16, 16, 3)
    assert postprocess(np.zeros((16, 16, 3), np.float32))[0, 0, 0, 0] == 128  # 0.5 * 255 = 127.5 -> 128
