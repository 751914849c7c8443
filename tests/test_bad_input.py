"""The rows of docs/cli.md "Bad input and its messages": one line on stderr, the exit code, no traceback,
nothing written. Runs the `tiny` model (written by the project's own writer) from a private cache."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture
def env(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(cache))
    monkeypatch.setenv("FLUX2KLEIN_COMPILE_CACHE", str(cache / "executables"))
    return tmp_path


def png_header(path: Path, width: int, height: int) -> Path:
    """A PNG that declares a size and holds almost no data: only its header is ever read."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) +
                     chunk(b"IEND", b""))
    return path


def small_png(path: Path) -> Path:
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(path)
    return path


# args, expected exit code, text the one line must hold. {tmp} is the test's folder.
ROWS = {
    "path with [/]": (["generate", "x", "--model", "models/no[/]where"], 2, "models/no[/]where: no such directory"),
    "path with [bold]": (["generate", "x", "--model", "models/[bold]x"], 2, "models/[bold]x: no such directory"),
    "height not an integer": (["generate", "x", "--height", "64.5"], 2, "Invalid value for '--height'"),
    "unknown option": (["generate", "x", "--heigth", "64"], 2, "No such option: --heigth"),
    "guidance nan": (["generate", "x", "--guidance", "nan"], 2, "'nan' is not a finite number"),
    "guidance inf": (["generate", "x", "--guidance", "inf"], 2, "'inf' is not a finite number"),
    "threshold -inf": (["parity", "--threshold", "-inf"], 2, "'-inf' is not a finite number"),
    "five references": (["edit", "x"] + ["-i", "{tmp}/a.png"] * 5, 2, "at most 4 are supported"),
    "reference over 16384x16384": (["edit", "x", "-i", "{tmp}/huge.png"], 2,
                                   "is 17000x17000 (289 megapixels); the limit is 67 megapixels"),
    "size past every limit": (["generate", "x", "--height", "1048576", "--width", "1048576"], 2,
                              "--height must be at most 16384 px, got 1048576"),
    "more images than a run takes": (["generate", "x", "-n", "1000000"], 2, "--num-images must be at most 1024"),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_bad_input_row(row: str, env: Path) -> None:
    small_png(env / "a.png")
    png_header(env / "huge.png", 17000, 17000)
    before = sorted(p.name for p in env.iterdir())
    args, code, expected = ROWS[row]
    args = [a.replace("{tmp}", str(env)) for a in args]
    if args[0] in ("generate", "edit"):
        args += ["-o", str(env / "out.png")] + ([] if "--model" in args else ["--model", "tiny"])
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in result.output and "Warning" not in result.output and "╭" not in result.output
    assert result.stdout == ""
    assert sorted(p.name for p in env.iterdir()) == before


def test_help_keeps_its_box() -> None:
    result = runner.invoke(app, ["generate", "--help"])
    assert result.exit_code == 0 and "╭" in result.stdout and "--guidance" in result.stdout


def test_inspect_checks_the_tokenizer_as_generate_does(env: Path, cache: Path) -> None:
    import shutil

    from flux2klein_cli.core.hub.snapshot import resolve_model

    copy = env / "snapshot"
    shutil.copytree(resolve_model("tiny"), copy)
    (copy / "tokenizer" / "tokenizer.json").unlink()
    for command in (["inspect", str(copy)], ["generate", "x", "--model", str(copy), "-o", str(env / "o.png")]):
        result = runner.invoke(app, command, catch_exceptions=False)
        assert result.exit_code == 2, (command, result.output)
        assert "tokenizer" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_device_out_of_memory_is_exit_1_in_one_line(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flux2klein_cli.core.pipeline.pipeline import KleinPipeline

    def exhausted(self: KleinPipeline, plan: object, **run: object) -> None:
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 bytes.")

    monkeypatch.setattr(KleinPipeline, "__call__", exhausted)
    result = runner.invoke(app, ["generate", "x", "--model", "tiny", "-o", str(env / "o.png")],
                           catch_exceptions=False)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: the device ran out of memory for 1 image(s)"), result.stderr
    assert "Traceback" not in result.output and not (env / "o.png").exists()
