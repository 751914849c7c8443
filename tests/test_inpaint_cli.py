"""`flux2klein edit --init-image / --mask / --strength / --reference-max-area` through the CLI:
bad input is one line and exit 2 with nothing written; a run writes what it was given into the
PNG; and an inpainting run's programs are stored, so a second process compiles nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from tests.test_bad_input import cache, env  # noqa: F401 (fixtures)
from tests.test_compile_counter import worker

runner = CliRunner()


def images(folder: Path) -> None:
    y, x = np.mgrid[0:96, 0:128]
    init = np.stack([x * 2, y * 2, np.full_like(x, 120)], -1).astype(np.uint8)
    Image.fromarray(init).save(folder / "init.png")
    Image.fromarray(init[:90, :120]).save(folder / "odd.png")
    mask = np.zeros((96, 128), np.uint8)
    mask[24:72, 40:100] = 255
    Image.fromarray(mask).save(folder / "mask.png")
    Image.fromarray(np.stack([mask] * 3, -1)).save(folder / "mask_rgb.png")  # gray levels in RGB: accepted
    Image.fromarray(mask[:, :112]).save(folder / "narrow.png")
    colour = np.zeros((96, 128, 3), np.uint8)
    colour[..., 0] = 255
    Image.fromarray(colour).save(folder / "red.png")


ROWS = {
    "mask of another size": (["--init-image", "init.png", "--mask", "narrow.png"],
                             "--mask is 112x96 but the init image (--init-image) is 128x96"),
    "colour mask": (["--init-image", "init.png", "--mask", "red.png"], "--mask is not grayscale"),
    "strength 0": (["--init-image", "init.png", "--strength", "0"], "--strength must be a number in (0, 1]"),
    "strength above 1": (["--init-image", "init.png", "--strength", "1.01"], "--strength must be a number in (0, 1]"),
    "strength nan": (["--init-image", "init.png", "--strength", "nan"], "'nan' is not a finite number"),
    "init image off the multiple": (["--init-image", "odd.png"],
                                    "--init-image is 120x90; both sides must be multiples of 16"),
    "mask without init image": (["-i", "init.png", "--mask", "mask.png"], "--mask needs an init image"),
    "strength without init image": (["-i", "init.png", "--strength", "0.5"], "--strength needs an init image"),
    "kv with an init image": (["-i", "init.png", "--init-image", "init.png", "--kv", "--model", "tiny-kv"],
                              "--kv cannot take an init image"),
    "a size beside the init image": (["--init-image", "init.png", "--width", "64"],
                                     "--width is set by the init image"),
    "neither reference nor init image": ([], "--image is missing"),
    "reference max area too small": (["-i", "init.png", "--reference-max-area", "100"],
                                     "--reference-max-area must be at least 4096"),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_bad_input_is_one_line_and_exit_2(row: str, env: Path) -> None:  # noqa: F811
    images(env)
    before = sorted(p.name for p in env.iterdir())
    args, expected = ROWS[row]
    args = ["edit", "x", *(str(env / a) if a.endswith(".png") else a for a in args), "-o", str(env / "out.png")]
    if "--model" not in args:
        args += ["--model", "tiny"]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.output and result.stdout == ""
    assert sorted(p.name for p in env.iterdir()) == before


@pytest.mark.slow
def test_inpaint_run_writes_its_conditioning_into_the_png(env: Path) -> None:  # noqa: F811
    images(env)
    out = env / "out.png"
    result = runner.invoke(app, ["edit", "a red ball", "--model", "tiny", "--dtype", "fp32", "--steps", "2",
                                 "--init-image", str(env / "init.png"), "--mask", str(env / "mask_rgb.png"),
                                 "--strength", "0.5", "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with Image.open(out) as image:
        assert image.size == (128, 96)
        text = dict(image.text)
    assert text["init_image"] == str(env / "init.png") and text["mask"] == str(env / "mask_rgb.png")
    assert float(text["strength"]) == 0.5


@pytest.mark.slow
def test_an_inpaint_run_compiles_nothing_in_a_second_process(tiny_checkpoint: Path, tmp_path: Path) -> None:
    programs = {"text_encoder", "noise", "denoise", "vae_decode", "vae_encode_64x64", "vae_encode_64x96"}
    for attempt in range(3):  # the store keys on the package's source: an edit between the runs is a retry
        store = tmp_path / f"store-{attempt}"
        first = worker(tiny_checkpoint, store, "--inpaint")
        assert first["statuses"] == dict.fromkeys(programs, "miss")
        later = worker(tiny_checkpoint, store, "--inpaint")
        if later["code"] == first["code"]:
            break
    assert later["statuses"] == dict.fromkeys(programs, "hit")
    assert later["all_compiles"] == []
    # A text-to-image run's denoise program is not the inpainting one: it misses in the same store.
    plain = worker(tiny_checkpoint, store)
    assert plain["statuses"]["denoise"] == "miss"


@pytest.mark.slow
def test_parity_with_an_init_image_a_mask_and_its_crop(tiny_checkpoint: Path, tmp_path: Path) -> None:
    import json

    images(tmp_path)
    result = runner.invoke(app, ["parity", "--model", str(tiny_checkpoint), "--steps", "3", "--init-image",
                                 str(tmp_path / "init.png"), "--mask", str(tmp_path / "mask.png"), "--strength", "0.7",
                                 "--padding-mask-crop", "8", "--out-dir", str(tmp_path / "parity"), "--json"],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["pipeline"] == "Flux2KleinInpaintPipeline" and (report["width"], report["height"]) == (128, 96)
    with Image.open(report["files"]["ours"]) as ours:  # the plan ran with it: its record says so
        assert report["padding_mask_crop"] == 8 and ours.text["padding_mask_crop"] == "8"
    assert report["ssim"] >= 0.999 and report["max_diff"] <= 2, report


def test_reference_max_area_sizes_references_and_keys_batches(tmp_path: Path) -> None:
    from flux2klein_cli.core.engine.plan import ModelFacts, RunFields, build_plan
    from flux2klein_cli.core.errors import FieldError

    Image.fromarray(np.zeros((300, 400, 3), np.uint8)).save(tmp_path / "ref.png")
    from flux2klein_cli.core.compile.model_configs import model_configs

    facts = ModelFacts.of("tiny", model_configs("tiny"))
    fields = RunFields(prompts=("x",), references=(tmp_path / "ref.png",))
    default = build_plan(fields, facts)
    small = build_plan(RunFields(prompts=("x",), references=(tmp_path / "ref.png",), reference_max_area=128 * 128),
                       facts)
    assert default.reference_sizes == ((288, 400),) and small.reference_sizes == ((96, 144),)
    assert default.batch_key() != small.batch_key()
    with pytest.raises(FieldError, match="reference_max_area"):
        build_plan(RunFields(prompts=("x",), references=(tmp_path / "ref.png",), reference_max_area=0), facts)
