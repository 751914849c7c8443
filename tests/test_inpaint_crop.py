"""`padding_mask_crop`: inpaint the mask's box (padded, grown to the output's aspect) at the output
size, then paste it back. Each step against diffusers' own (get_crop_region, the "fill" and "crop"
resizes, apply_overlay) exactly, and a whole run against Flux2KleinInpaintPipeline with
padding_mask_crop on the tiny checkpoint (fp32, shared noise), its paste back mended: diffusers
0.42 pastes back a centre crop of the made image instead of resizing it into the box (see
test_diffusers_pastes_back_a_centre_crop); flux2klein does what diffusers' docs say."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flux2klein_cli.core.engine.plan import ModelFacts, RunFields, build_plan
from flux2klein_cli.core.errors import FieldError
from flux2klein_cli.core.inputs import conditioning
from flux2klein_cli.core.pipeline.pixels import paste_back
from tests.fixtures.engine import engine_on, upload
from tests.test_bad_input import cache, env  # noqa: F401 (fixtures)
from tests.test_inpaint import box_mask
from tests.test_pipeline_parity import check, synthetic_image


def processors() -> tuple[object, object]:
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    image = Flux2ImageProcessor(vae_scale_factor=16, vae_latent_channels=32)
    mask = Flux2ImageProcessor(vae_scale_factor=16, vae_latent_channels=32, do_normalize=False, do_binarize=True,
                               do_convert_rgb=False, do_convert_grayscale=True)
    return image, mask


MASKS = [((96, 64), (40, 20, 64, 44), 8), ((96, 64), (0, 0, 20, 60), 0), ((64, 96), (50, 80, 64, 96), 32),
         ((128, 64), (60, 10, 70, 14), 4), ((80, 80), (5, 30, 75, 40), 100), ((96, 64), (90, 0, 96, 64), 2)]


@pytest.mark.parametrize("size, box, pad", MASKS)
def test_the_crop_box_and_resizes_are_diffusers(size: tuple[int, int], box: tuple[int, int, int, int],
                                                pad: int) -> None:
    image_processor, mask_processor = processors()
    mask = box_mask(*size, box)
    ours = conditioning.crop_box(mask, *size, pad)
    assert ours == mask_processor.get_crop_region(mask, *size, pad=pad)
    init = synthetic_image(*size, 21)
    theirs = image_processor.preprocess(init, size[1], size[0], crops_coords=ours, resize_mode="fill")
    np.testing.assert_array_equal(conditioning.preprocess_init_image(init, multiple_of=16, box=ours),
                                  theirs[0].permute(1, 2, 0).numpy())
    theirs_mask = mask_processor.preprocess(mask, height=size[1], width=size[0], resize_mode="fill", crops_coords=ours)
    np.testing.assert_array_equal(conditioning.preprocess_mask(mask, size, multiple_of=16, box=ours),
                                  theirs_mask[0, 0].numpy())
    # The paste back: diffusers' intent (VaeImageProcessor's apply_overlay and its "crop" resize);
    # Flux2ImageProcessor's own is broken (test_diffusers_pastes_back_a_centre_crop).
    from diffusers.image_processor import VaeImageProcessor

    made = np.asarray(synthetic_image(*size, 22))
    pasted = VaeImageProcessor(vae_scale_factor=16).apply_overlay(mask, init, Image.fromarray(made), ours)
    np.testing.assert_array_equal(
        paste_back(made[None], np.asarray(init.convert("RGBA")), np.asarray(mask), ours)[0],
        np.asarray(pasted))


def test_diffusers_pastes_back_a_centre_crop() -> None:
    """diffusers 0.42's Flux2KleinInpaintPipeline pastes back with Flux2ImageProcessor.apply_overlay,
    whose "crop" resize is that class's override for references, a plain centre crop: the box gets
    the middle of the made image, unscaled, though the made image is the box scaled up. flux2klein
    resizes it into the box (its documented intent). When this fails, diffusers changed: look again."""
    image_processor, mask_processor = processors()
    init, mask = synthetic_image(96, 64, 27), box_mask(96, 64, (40, 20, 64, 44))
    x1, y1, x2, y2 = box = mask_processor.get_crop_region(mask, 96, 64, pad=8)
    made = np.asarray(synthetic_image(96, 64, 28))
    theirs = np.asarray(image_processor.apply_overlay(mask, init, Image.fromarray(made), box))
    top, left = (64 - (y2 - y1)) // 2, (96 - (x2 - x1)) // 2
    centre = np.zeros_like(made)
    centre[y1:y2, x1:x2] = made[top:top + y2 - y1, left:left + x2 - x1]
    inside = np.asarray(mask) == 255
    np.testing.assert_array_equal(theirs[inside], centre[inside])
    ours = paste_back(made[None], np.asarray(init.convert("RGBA")), np.asarray(mask), box)[0]
    assert np.abs(ours[inside].astype(int) - theirs[inside]).mean() > 20


def test_the_paste_back_resizes_the_crop_into_its_box() -> None:
    """What diffusers' apply_overlay does, by hand: inside the box the made image Lanczos-resized
    to the box (not a centre crop of it), elsewhere the init image."""
    init, mask = synthetic_image(96, 64, 23), box_mask(96, 64, (40, 20, 64, 44))
    box = conditioning.crop_box(mask, 96, 64, 8)
    assert box == (22, 12, 82, 52)  # 40x40 padded, grown to 60x40 (the output's 3:2)
    made = np.asarray(synthetic_image(96, 64, 24))
    out = paste_back(made[None], np.asarray(init.convert("RGBA")), np.asarray(mask), box)[0]
    resized = np.asarray(Image.fromarray(made).resize((60, 40), Image.Resampling.LANCZOS))
    inside = np.asarray(mask) == 255
    np.testing.assert_array_equal(out[12:52, 22:82][inside[12:52, 22:82]], resized[inside[12:52, 22:82]])
    np.testing.assert_array_equal(out[~inside], np.asarray(init)[~inside])


def test_padding_mask_crop_is_checked_in_the_plan(tmp_path: Path) -> None:
    from flux2klein_cli.core.compile.model_configs import model_configs

    facts = ModelFacts.of("tiny", model_configs("tiny"))
    synthetic_image(96, 64, 25).save(tmp_path / "init.png")
    box_mask(96, 64, (40, 20, 64, 44)).save(tmp_path / "mask.png")
    Image.new("L", (96, 64)).save(tmp_path / "black.png")
    base = dict(prompts=("x",), init_image=tmp_path / "init.png")
    plan = build_plan(RunFields(**base, mask=tmp_path / "mask.png", padding_mask_crop=8), facts)
    assert plan.crop_box == (22, 12, 82, 52) and (plan.height, plan.width) == (64, 96)
    assert plan.paste_image.shape == (64, 96, 4) and plan.paste_mask.shape == (64, 96)
    plain = build_plan(RunFields(**base, mask=tmp_path / "mask.png"), facts)
    assert plain.crop_box is None and plain.batch_key() != plan.batch_key()
    assert not np.array_equal(plain.init_image, plan.init_image)
    for fields, message in [(RunFields(**base, padding_mask_crop=8), "padding_mask_crop needs a mask"),
                            (RunFields(prompts=("x",), padding_mask_crop=8), "padding_mask_crop needs an init image"),
                            (RunFields(**base, mask=tmp_path / "mask.png", padding_mask_crop=-1), "at least 0"),
                            (RunFields(**base, mask=tmp_path / "black.png", padding_mask_crop=0), "black everywhere")]:
        with pytest.raises(FieldError, match=message):
            build_plan(fields, facts)


def test_padding_mask_crop_matches_diffusers(tiny_checkpoint: Path) -> None:
    """The whole run, the paste back included, against diffusers' (its paste back mended: see
    run_reference): the init image, exactly, outside the mask."""
    init, mask = synthetic_image(96, 64, 26), box_mask(96, 64, (40, 20, 64, 44))
    parity = check(engine_on(tiny_checkpoint), RunFields(
        prompts=("a red ball",), steps=4, seed=3, strength=0.8, init_image=upload(init, "init.png"),
        mask=upload(mask, "mask.png"), padding_mask_crop=8))
    outside = np.asarray(mask) == 0
    for images in (parity.ours, parity.reference):
        np.testing.assert_array_equal(images[0][outside], np.asarray(init)[outside])
    assert parity.reference[0][~outside].std() > 10


@pytest.mark.parametrize("args, expected", [
    (["--init-image", "init.png", "--padding-mask-crop", "8"], "--padding-mask-crop needs a mask (--mask)"),
    (["-i", "init.png", "--padding-mask-crop", "8"], "--padding-mask-crop needs an init image (--init-image)"),
    (["--init-image", "init.png", "--mask", "mask.png", "--padding-mask-crop", "-3"],
     "--padding-mask-crop must be at least 0"),
])
def test_bad_padding_mask_crop_is_one_line_and_exit_2(env: Path, args: list[str], expected: str) -> None:  # noqa: F811
    from typer.testing import CliRunner

    from flux2klein_cli.cli.app import app
    from tests.test_inpaint_cli import images

    images(env)
    args = ["edit", "x", "--model", "tiny", *(str(env / a) if a.endswith(".png") else a for a in args),
            "-o", str(env / "out.png")]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert not (env / "out.png").exists()


@pytest.mark.slow
def test_an_edit_with_padding_mask_crop_keeps_the_init_image_outside_the_mask(env: Path) -> None:  # noqa: F811
    from typer.testing import CliRunner

    from flux2klein_cli.cli.app import app
    from tests.test_inpaint_cli import images

    images(env)
    out = env / "out.png"
    result = CliRunner().invoke(app, ["edit", "a red ball", "--model", "tiny", "--dtype", "fp32", "--steps", "2",
                                      "--init-image", str(env / "init.png"), "--mask", str(env / "mask.png"),
                                      "--padding-mask-crop", "4", "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with Image.open(out) as image:
        assert image.text["padding_mask_crop"] == "4" and image.text["mask"] == str(env / "mask.png")
        pixels = np.asarray(image.convert("RGB"))
    keep = np.asarray(Image.open(env / "mask.png")) == 0
    np.testing.assert_array_equal(pixels[keep], np.asarray(Image.open(env / "init.png").convert("RGB"))[keep])


def test_mask_levels_reads_transparency_only_when_asked() -> None:
    """serve's rule: with transparency anywhere, repaint = 255 - alpha; opaque, or not asked (the
    CLI, batch: diffusers reads the gray levels), the gray levels."""
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[..., 3] = 255
    rgba[2:5, 2:6, 3] = 0
    image = Image.fromarray(rgba, "RGBA")
    np.testing.assert_array_equal(np.asarray(conditioning.mask_levels(image, alpha=True)), 255 - rgba[..., 3])
    assert not np.asarray(conditioning.mask_levels(image)).any()  # black RGB: keep everything
    rgba[..., 3], rgba[..., :3] = 255, 255
    assert np.asarray(conditioning.mask_levels(Image.fromarray(rgba, "RGBA"), alpha=True)).min() == 255
