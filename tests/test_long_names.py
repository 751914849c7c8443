"""Long names (issue 16, part 4): a temporary fits whenever its final name does, so a valid
250-character `-o` keeps its image; names over the filesystem's limit are exit 2 before the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core import temporaries
from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.runs.image_files import write_png
from flux2klein_cli.core.temporaries import MARK, partial_name, remove_stale, stem

runner = CliRunner()
LONG = "a" * 300


def cli(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("name", ["x.png", "b" * 246 + ".png", "é" * 127, "x" + "é" * 127, "c" * 185, "c" * 186,
                                  "d" * 255])
def test_a_temporary_name_fits_whenever_the_final_name_does(name: str) -> None:
    assert len(os.fsencode(name)) <= 255
    assert len(os.fsencode(partial_name(name))) <= 255
    assert stem(name) == stem(name)  # the same in every process: stale removal finds it
    short = len(os.fsencode(name)) <= 185
    assert (stem(name) == name) is short


def test_stale_removal_recognises_shortened_temporaries(tmp_path: Path) -> None:
    name = "e" * 250 + ".png"
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)  # a process that has exited
    left = tmp_path / f".{stem(name)}{MARK}{temporaries._host()}-{dead}-0123abcd"
    left.write_bytes(b"half")
    other = tmp_path / f".{stem('f' * 250)}{MARK}{temporaries._host()}-{dead}-0123abcd"
    other.write_bytes(b"another name's")
    assert remove_stale(tmp_path, name) == [left]
    assert not left.exists() and other.exists()


def test_a_250_character_png_name_is_written(tmp_path: Path) -> None:
    path = tmp_path / ("b" * 246 + ".png")
    write_png(path, np.zeros((8, 8, 3), np.uint8), {"prompt": "x"}, force=False)
    assert path.is_file() and [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=1)


@pytest.mark.slow  # a full tiny run (compiles): ~30 s on a shared CPU; write_png's test above is the fast check
def test_generate_with_a_250_character_name_keeps_the_image(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / ("b" * 246 + ".png")
    result = cli("generate", "a fox", "--model", tiny, "--steps", "1", "--height", "32", "--width", "32", "-o", out)
    assert result.exit_code == 0, result.stderr
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == [out.name]


def _error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("option", ["-o", "--latents", "--model", "-n 2 -o", "--compile-cache", "--prompt-file"])
def test_generate_names_over_the_limit_are_exit_2_before_loading(option: str, tiny: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from flux2klein_cli.core.pipeline import pipeline

    monkeypatch.setattr(pipeline.KleinPipeline, "load", lambda *a, **k: pytest.fail("loaded the model"))
    *flags, flag = option.split()
    value = tmp_path / ("c" * 250 + ".png") if flags else tmp_path / (LONG + ".png")  # -n 2: NAME-0.png is 256
    model = LONG if flag == "--model" else tiny
    prompt = [] if flag == "--prompt-file" else ["a fox"]
    args = ["generate", *prompt, "--steps", "1", "--height", "32", "--width", "32", *flags,
            *((flag, value) if flag != "--model" else ()), "--model", model]
    line = _error_line(cli(*args))
    assert "too long" in line
    assert list(tmp_path.iterdir()) == []


def test_edit_reference_over_the_limit_is_exit_2(tiny: Path, tmp_path: Path) -> None:
    reference = tmp_path / (LONG + ".png")
    line = _error_line(cli("edit", "a fox", "--model", tiny, "-i", reference, "-o", tmp_path / "x.png"))
    assert line.startswith("error: --image ") and "file name too long (304 bytes; the limit is 255)" in line


def test_convert_names(tiny: Path, tmp_path: Path) -> None:
    line = _error_line(cli("convert", tiny, "--out", tmp_path / LONG))
    assert "--out" in line and "too long" in line
    line = _error_line(cli("convert", tmp_path / LONG))
    assert "--model" in line and "too long" in line
    out = tmp_path / ("k" * 250)  # fits: so does its temporary directory
    result = cli("convert", tiny, "--out", out)
    assert result.exit_code == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
