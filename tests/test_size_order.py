"""One order for sizes the tool prints and stores: WIDTHxHEIGHT (OpenAI's `size`, image viewers),
checked on a non-square run so that the two orders differ. `--refs` alone reads HEIGHTxWIDTH."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.cli.flags import message
from flux2klein_cli.core import limits
from flux2klein_cli.core.errors import FieldError
from flux2klein_cli.core.runs.image_files import read_run_metadata

runner = CliRunner()


def test_the_pixel_limit_names_width_then_height() -> None:
    with pytest.raises(FieldError) as err:
        limits.check_size(16384, 8192)  # height, width
    assert message(err.value).startswith("--width x --height is 8192x16384 = 134217728 px; the limit is ")
    assert str(err.value).startswith("width x height is 8192x16384")  # as a server names the fields


@pytest.mark.slow
def test_generate_summary_png_and_compile_agree(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "fox.png"
    done = runner.invoke(app, ["generate", "a fox", "--model", str(tiny_checkpoint), "--height", "32",
                               "--width", "48", "--steps", "1", "--dtype", "fp32", "-o", str(out),
                               "--compile-cache", str(tmp_path / "store")])
    assert done.exit_code == 0, done.stderr[-2000:]
    assert "1 image(s) 48x32, 1 steps" in done.stderr
    assert (read_run_metadata(out)["width"], read_run_metadata(out)["height"]) == (48, 32)

    compiled = runner.invoke(app, ["compile", "--model", str(tiny_checkpoint), "--height", "32", "--width", "48",
                                   "--refs", "16x64", "--steps", "1", "--dtype", "fp32",
                                   "--compile-cache", str(tmp_path / "store"), "--json"])
    assert compiled.exit_code == 0, compiled.stderr[-2000:]
    report = json.loads(compiled.stdout)
    assert (report["height"], report["width"]) == (32, 48)
    assert report["references"] == ["64x16"]  # --refs 16x64 is 16 high, 64 wide
    table = runner.invoke(app, ["compile", "--model", str(tiny_checkpoint), "--height", "32", "--width", "48",
                                "--refs", "16x64", "--steps", "1", "--dtype", "fp32",
                                "--compile-cache", str(tmp_path / "store")], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.stderr[-2000:]
    assert f"{tiny_checkpoint.name} 48x32, batch 1" in table.output
