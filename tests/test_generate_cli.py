"""`generate` and `edit` as a script calls them: outputs, metadata, JSON, and every kind of bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.runs.image_files import read_run_metadata
from tests.fixtures.images import assert_same_seed_image

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def image_file(path: Path, width: int, height: int) -> Path:
    rng = np.random.default_rng(width * height)
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)
    return path


@contextmanager
def xla_compiles() -> Iterator[list[float]]:
    """The XLA compiles made inside the block (their durations)."""
    seen: list[float] = []

    def listen(event: str, duration: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.slow
def test_generate_writes_pngs_with_metadata_and_json(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "fox.png"
    fox = ("generate", "a red fox in snow", "--model", tiny_checkpoint, "--height", 48, "--width", 64,
           "--num-images", 2, "--seed", 7, "--steps", 2, "--dtype", "fp32", "--json")
    store = tmp_path / "executables"  # this test's own store: the session's is shared
    with xla_compiles() as built:
        result = run(*fox, "-o", out, "--compile-cache", store)
    assert built  # the counter sees this run's compiles
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["outputs"] == [str(tmp_path / "fox-0.png"), str(tmp_path / "fox-1.png")]
    assert report["seeds"] == [7, 8] and report["steps"] == 2 and report["cfg"] is False
    from flux2klein_cli.core.models import kernels  # what this host's CPU runs take, and why

    assert report["cpu_kernels"] == kernels.report()
    assert report["cpu_kernels"]["why"]
    for path, seed in zip(report["outputs"], (7, 8), strict=True):
        image = Image.open(path)
        assert image.size == (64, 48) and image.mode == "RGB"
        meta = read_run_metadata(path)
        assert meta["prompt"] == "a red fox in snow" and meta["seed"] == seed and meta["steps"] == 2
        assert (meta["width"], meta["height"]) == (64, 48) and meta["model"] == str(tiny_checkpoint)
        assert meta["record"] == 3 and "version" in meta
    first, second = (np.asarray(Image.open(p)) for p in report["outputs"])
    assert not np.array_equal(first, second)  # different seeds, different noise

    # Seed 8 alone reproduces the second image of the batch exactly.
    again = run("generate", "a red fox in snow", "--model", tiny_checkpoint, "-o", tmp_path / "again.png", "--height",
                48, "--width", 64, "--seed", 8, "--steps", 2, "--dtype", "fp32")
    assert again.exit_code == 0, again.stderr
    assert again.stdout.strip() == str(tmp_path / "again.png")
    assert_same_seed_image(np.asarray(Image.open(tmp_path / "again.png")), second)
    # The run stored every program it compiled, so the next run of these shapes compiles nothing.
    programs = [p["name"] for p in report["executables"]]
    assert programs and all(p["status"] == "miss" for p in report["executables"]), report["executables"]
    with xla_compiles() as rebuilt:
        repeat = run(*fox, "-o", tmp_path / "repeat.png", "--compile-cache", store)
    assert repeat.exit_code == 0, repeat.stderr
    statuses = {p["name"]: p["status"] for p in json.loads(repeat.stdout)["executables"]}
    assert statuses == dict.fromkeys(programs, "hit") and rebuilt == []


@pytest.mark.slow
def test_edit_takes_the_first_reference_size(tiny_checkpoint: Path, tmp_path: Path) -> None:
    a = image_file(tmp_path / "a.png", 100, 75)  # processed to 96 x 64
    b = image_file(tmp_path / "b.jpg", 64, 128)
    out = tmp_path / "edit.png"
    result = run("edit", "put both on the sofa", "--image", a, "--image", b, "--model", tiny_checkpoint, "-o", out,
                 "--steps", 2, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["width"], report["height"]) == (96, 64)
    assert Image.open(out).size == (96, 64)
    assert read_run_metadata(out)["references"] == [str(a), str(b)]


@pytest.mark.slow
def test_prompt_file_gives_one_image_per_line(tiny_checkpoint: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n\na lighthouse at dawn\n")
    result = run("generate", "--prompt-file", prompts, "--model", tiny_checkpoint, "-o", tmp_path / "p.png",
                 "--height", 32, "--width", 32, "--steps", 1, "--json")
    assert result.exit_code == 0, result.stderr
    outputs = json.loads(result.stdout)["outputs"]
    assert [read_run_metadata(p)["prompt"] for p in outputs] == ["a red fox", "a lighthouse at dawn"]


BAD = {
    "missing image": (["edit", "x", "--image", "{tmp}/nope.png"], "nope.png"),
    "not an image": (["edit", "x", "--image", "{tmp}/notes.txt"], "notes.txt"),
    "side under 64": (["edit", "x", "--image", "{tmp}/small.png"], "64"),
    "aspect over 8": (["edit", "x", "--image", "{tmp}/wide.png"], "aspect"),
    "height not multiple of 16": (["generate", "x", "--height", "100", "--width", "64"], "multiple of 16"),
    "width not multiple of 16": (["generate", "x", "--height", "64", "--width", "70"], "multiple of 16"),
    "empty prompt": (["generate", "  "], "PROMPT is empty"),
    "no prompt": (["generate"], "PROMPT is missing: pass it or --prompt-file"),
    "steps under 1": (["generate", "x", "--steps", "0"], "--steps"),
    "latents of the wrong shape": (["generate", "x", "--height", "64", "--width", "64", "--latents",
                                    "{tmp}/noise.npy"], "shape"),
    "existing output without --force": (["generate", "x", "-o", "{tmp}/exists.png"], "--force"),
    "unknown dtype": (["generate", "x", "--dtype", "fp8"], "dtype"),
    "seed past 32 bits": (["generate", "x", "--seed", "4294967295", "--num-images", "2"], "below 2**32"),
    "unknown effort": (["generate", "x", "--effort", "max"], "--effort must be one of"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_exit_2_one_line_nothing_written(case: str, tiny_checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a picture")
    image_file(tmp_path / "small.png", 63, 200)
    image_file(tmp_path / "wide.png", 900, 100)
    np.save(tmp_path / "noise.npy", np.zeros((1, 128, 5, 4), np.float32))
    (tmp_path / "exists.png").write_bytes(b"keep me")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    args, expected = BAD[case]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "-o" not in args:
        args += ["-o", str(tmp_path / "out.png")]
    result = run(*args, "--model", tiny_checkpoint)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert expected in lines[0] and "Traceback" not in result.output
    assert result.stdout == ""
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after == before  # nothing written, nothing overwritten


@pytest.mark.slow
def test_readme_main_command_runs_on_the_embedded_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The README's first command: the tiny checkpoint is written on first use, the default size is 256.
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "cache"))
    result = run("generate", "a red fox in snow", "--model", "tiny", "-o", tmp_path / "fox.png", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["width"], report["height"], report["steps"]) == (256, 256, 4)
    assert Image.open(tmp_path / "fox.png").size == (256, 256)
    assert (tmp_path / "cache").is_dir()
