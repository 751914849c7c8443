"""`generate --from IMAGE.png` / `edit --from` rerun an image from its PNG's parameters, options beside it
win; `inspect IMAGE.png` prints them; every bad PNG is one line, exit 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.runs import from_png
from flux2klein_cli.core.runs.image_files import read_run_metadata, write_png

runner = CliRunner()
TINY = ("--model", "tiny", "--height", "32", "--width", "48", "--steps", "1", "--max-sequence-length", "16")
PIXELS = np.zeros((32, 48, 3), np.uint8)


def run(*args: object) -> Any:
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path))


def one_line_exit_2(result: Any, *needles: str) -> None:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def made_png(path: Path, **changes: Any) -> Path:
    """A PNG with the record 2 parameters generate wrote before record 3 (no model run)."""
    meta = dict(prompt="a fox", negative_prompt="", seed=3, steps=1, guidance=1.0, size="48x32", model="tiny",
                references=[], dtype="bf16", version="0.1.0", max_sequence_length=16)
    meta.update(changes)
    return write_png(path, PIXELS, {k: v for k, v in meta.items() if v is not None}, force=False)


# --- reading the parameters back -----------------------------------------------------------------


def test_a_record_2_png_reads_as_the_fields_it_gave(tmp_path: Path) -> None:
    """PNGs written before record 3 (`size`, a seed `latents:PATH`) read back as record 3's fields."""
    png = made_png(tmp_path / "a.png", lora=[{"path": "style.safetensors", "scale": 0.8, "sha256": "x"}],
                   transformer="other/repo")
    assert from_png.parameters(png, "generate") == dict(
        prompt="a fox", negative_prompt="", steps=1, guidance=1.0, width=48, height=32, seed=3, model="tiny",
        dtype="bf16", transformer="other/repo", lora=["style.safetensors:0.8"], max_sequence_length=16)
    noise = tmp_path / "noise.npy"
    np.save(noise, np.zeros((1, 128, 2, 3), np.float32))
    latents = made_png(tmp_path / "l.png", seed=f"latents:{noise}")
    got = from_png.parameters(latents, "generate")
    assert got["latents"] == noise and "seed" not in got


def test_the_record_round_trips_a_plan(tmp_path: Path) -> None:
    """encode -> PNG -> decode gives the fields and engine options that plan the same run again."""
    from dataclasses import replace

    from flux2klein_cli.core.compile.model_configs import model_configs
    from flux2klein_cli.core.engine.engine import EngineOptions
    from flux2klein_cli.core.engine.plan import ModelFacts, RunFields, build_plan
    from flux2klein_cli.core.runs import run_record

    Image.fromarray(np.full((64, 96, 3), 90, np.uint8)).save(tmp_path / "init.png")
    Image.fromarray(np.full((64, 96), 255, np.uint8)).save(tmp_path / "mask.png")
    Image.fromarray(np.zeros((80, 64, 3), np.uint8)).save(tmp_path / "ref.png")
    facts = ModelFacts.of("tiny", model_configs("tiny"))
    fields = RunFields(prompts=("a fox", "a hare"), references=(tmp_path / "ref.png",), steps=3, guidance=2.5,
                       negative_prompt="fog", seed=11, num_images=2, max_sequence_length=24,
                       init_image=tmp_path / "init.png", mask=tmp_path / "mask.png", strength=0.6,
                       padding_mask_crop=8, reference_max_area=64 * 64)
    plan = build_plan(fields, facts)
    options = EngineOptions(model="tiny", dtype="fp32", transformer="elsewhere/t", lora=("style.safetensors:0.5",))
    lora = [{"path": "style.safetensors", "scale": 0.5}]
    for index in range(plan.batch):
        png = write_png(tmp_path / f"{index}.png", PIXELS, run_record.encode(plan, index, options, lora), force=False)
        got = run_record.decode(read_run_metadata(png), png)
        again = build_plan(RunFields(
            prompts=(got["prompt"],), references=tuple(got["references"]), height=got["height"], width=got["width"],
            steps=got["steps"], guidance=got["guidance"], negative_prompt=got["negative_prompt"], seed=got["seed"],
            max_sequence_length=got["max_sequence_length"], init_image=got["init_image"], mask=got["mask"],
            strength=got["strength"], padding_mask_crop=got["padding_mask_crop"],
            reference_max_area=got["reference_max_area"]), facts)
        image = replace(plan, prompts=(plan.prompts[index // 2],), seeds=(plan.seeds[index],), num_images=1,
                        negative_prompt="")  # a distilled model has no negative pass: none is recorded
        assert again == image and not plan.cfg
        assert (got["model"], got["dtype"], got["transformer"], got["lora"]) == ("tiny", "fp32", "elsewhere/t",
                                                                                  ["style.safetensors:0.5"])


def test_options_given_win_and_groups_go_together(tmp_path: Path) -> None:
    png = from_png.parameters(made_png(tmp_path / "a.png"), "generate")
    arguments = dict(prompt=None, seed=0, latents=None, steps=None, model="4b", height=None, width=None)
    merged = from_png.overlay(png, arguments, {"steps"}, source="a.png")
    assert merged == dict(prompt="a fox", seed=3, latents=None, steps=None, model="tiny", height=32, width=48)
    assert from_png.overlay(png, arguments, {"prompt_file"}, source="a.png")["prompt"] is None
    noise = from_png.parameters(made_png(tmp_path / "l.png", seed=f"latents:{tmp_path / 'gone.npy'}"), "generate")
    assert from_png.overlay(noise, arguments, {"seed"}, source="l.png")["latents"] is None  # --seed: no latents


def test_names_image(tmp_path: Path) -> None:
    png = made_png(tmp_path / "a.png")
    renamed = png.rename(tmp_path / "a-png")  # PNG magic, no suffix
    assert from_png.names_image(str(renamed)) and from_png.names_image(str(tmp_path / "missing.png"))
    assert not from_png.names_image("tiny") and not from_png.names_image(str(tmp_path))


# --- bad PNGs: one line, exit 2, nothing written -------------------------------------------------


def test_png_without_parameters(tmp_path: Path) -> None:
    Image.fromarray(PIXELS).save(tmp_path / "plain.png")
    one_line_exit_2(run("generate", "--from", tmp_path / "plain.png", "-o", tmp_path / "o.png"),
                    "plain.png carries no flux2klein parameters")
    one_line_exit_2(run("inspect", tmp_path / "plain.png"), "carries no flux2klein parameters")
    assert not (tmp_path / "o.png").exists()


def test_not_a_png(tmp_path: Path) -> None:
    (tmp_path / "notes.png").write_text("not an image\n")
    (tmp_path / "notes.txt").write_text("not an image\n")
    one_line_exit_2(run("generate", "--from", tmp_path / "notes.txt", "-o", tmp_path / "o.png"), "is not a PNG")
    one_line_exit_2(run("inspect", tmp_path / "notes.png", "--json"), "is not a PNG")
    one_line_exit_2(run("inspect", tmp_path / "missing.png"), "does not exist")
    assert not (tmp_path / "o.png").exists()


def test_newer_metadata_format(tmp_path: Path) -> None:
    info = PngInfo()
    info.add_text("prompt", "a fox")
    info.add_itxt("flux2klein", json.dumps({"format": 99, "json": []}))
    Image.fromarray(PIXELS).save(tmp_path / "new.png", pnginfo=info)
    one_line_exit_2(run("generate", "--from", tmp_path / "new.png", "-o", tmp_path / "o.png"),
                    "metadata format 99, newer")
    with pytest.raises(UserInputError, match="newer"):
        from_png.parameters(tmp_path / "new.png", "edit")


def test_altered_parameters(tmp_path: Path) -> None:
    png = made_png(tmp_path / "a.png", steps="many")
    one_line_exit_2(run("generate", "--from", png, "-o", tmp_path / "o.png"),
                    'its steps must be a whole number, got "many"; the PNG\'s parameters were altered')


def test_missing_reference_and_edit_png(tmp_path: Path) -> None:
    png = made_png(tmp_path / "e.png", references=[str(tmp_path / "gone.png")], size="64x64")
    one_line_exit_2(run("generate", "--from", png, "-o", tmp_path / "o.png"), "made by edit", "edit --from")
    one_line_exit_2(run("edit", "--from", png, "-o", tmp_path / "o.png"), "no longer exist", "gone.png")
    assert not (tmp_path / "o.png").exists()


def test_missing_latents(tmp_path: Path) -> None:
    png = made_png(tmp_path / "l.png", seed=f"latents:{tmp_path / 'noise.npy'}")
    one_line_exit_2(run("generate", "--from", png, "-o", tmp_path / "o.png"), "noise.npy", "--seed")
    assert not (tmp_path / "o.png").exists()


# --- real reruns ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_from_reruns_bit_for_bit_and_overrides(tmp_path: Path) -> None:
    first = tmp_path / "a.png"
    made = run("generate", "a fox in snow", *TINY, "--seed", 3, "-o", first)
    assert made.exit_code == 0, made.stderr
    again = run("generate", "--from", first, "-o", tmp_path / "b.png")
    assert again.exit_code == 0, again.stderr
    assert np.array_equal(pixels(first), pixels(tmp_path / "b.png"))
    assert read_run_metadata(tmp_path / "b.png") == read_run_metadata(first)

    other = run("generate", "--from", first, "--seed", 5, "-o", tmp_path / "c.png")
    assert other.exit_code == 0, other.stderr
    assert not np.array_equal(pixels(first), pixels(tmp_path / "c.png"))
    assert read_run_metadata(tmp_path / "c.png") == {**read_run_metadata(first), "seed": 5}

    shown = run("inspect", first, "--json")
    assert shown.exit_code == 0, shown.stderr
    assert json.loads(shown.stdout) == read_run_metadata(first)
    table = run("inspect", first)
    assert table.exit_code == 0 and "a fox in snow" in table.stdout + table.stderr

    # A run from initial noise records its file and reruns from it.
    noise = tmp_path / "noise.npy"
    np.save(noise, np.random.default_rng(1).standard_normal((1, 128, 2, 3)).astype(np.float32))
    from_noise = run("generate", "a fox in snow", *TINY, "--latents", noise, "-o", tmp_path / "l.png")
    assert from_noise.exit_code == 0, from_noise.stderr
    assert read_run_metadata(tmp_path / "l.png")["latents"] == str(noise)
    rerun = run("generate", "--from", tmp_path / "l.png", "-o", tmp_path / "l2.png")
    assert rerun.exit_code == 0, rerun.stderr
    assert np.array_equal(pixels(tmp_path / "l.png"), pixels(tmp_path / "l2.png"))


@pytest.mark.slow
def test_edit_from_reruns_bit_for_bit(tmp_path: Path) -> None:
    reference = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(reference)
    first = tmp_path / "e.png"
    made = run("edit", "make it red", "-i", reference, "--model", "tiny", "--steps", 1,
               "--max-sequence-length", 16, "--seed", 2, "-o", first)
    assert made.exit_code == 0, made.stderr
    again = run("edit", "--from", first, "-o", tmp_path / "e2.png")
    assert again.exit_code == 0, again.stderr
    assert np.array_equal(pixels(first), pixels(tmp_path / "e2.png"))
    assert read_run_metadata(tmp_path / "e2.png") == read_run_metadata(first)
