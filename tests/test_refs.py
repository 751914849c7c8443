"""`--refs` means the same in `bench` and `compile`: a count of references at the output size,
or their sizes (core/pipeline/references.py is its one parser)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.pipeline.references import MAX_REFERENCES, parse_refs
from flux2klein_cli.core.runs.bench.run import BenchOptions

runner = CliRunner()


@pytest.mark.parametrize("text, sizes", [
    (None, ()), ("", ()), ("0", ()), (" 2 ", ((64, 96), (64, 96))),
    ("512x512", ((512, 512),)), ("512x512, 768X1024", ((512, 512), (768, 1024))),
])
def test_a_count_is_references_at_the_output_size_and_sizes_are_height_first(text: str | None, sizes: tuple) -> None:
    assert parse_refs(text, 64, 96) == sizes


@pytest.mark.parametrize("text, message", [
    (str(MAX_REFERENCES + 1), f"at most {MAX_REFERENCES} are supported"),
    (",".join(["64x64"] * (MAX_REFERENCES + 1)), f"at most {MAX_REFERENCES} are supported"),
    ("2,64x64", "'2' is neither a count nor HEIGHTxWIDTH"),
    ("64x", "'64x' is neither a count nor HEIGHTxWIDTH"),
    ("1.5", "'1.5' is neither a count nor HEIGHTxWIDTH"),
])
def test_bad_refs_are_user_errors(text: str, message: str) -> None:
    with pytest.raises(UserInputError, match=message):
        parse_refs(text, 64, 64)


def test_bench_reads_both_forms_at_its_output_size() -> None:
    assert BenchOptions(refs="2", height=512, width=768).reference_sizes() == ((512, 768), (512, 768))
    assert BenchOptions(refs="256x512").reference_sizes() == ((256, 512),)


@pytest.mark.parametrize("refs", ["9", "2x", "64x64,64x64,64x64,64x64,64x64"])
def test_both_commands_give_the_same_one_line_error(tiny_checkpoint: Path, tmp_path: Path, refs: str) -> None:
    errors = []
    for command in ("bench", "compile"):
        result = runner.invoke(app, [command, "--model", str(tiny_checkpoint), "--compile-cache", str(tmp_path),
                                     "--refs", refs])
        assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr
        errors.append(" ".join(result.stderr.split()))
    assert errors[0] == errors[1] and "--refs" in errors[0]
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_compile_takes_a_count_and_bench_takes_sizes(tiny_checkpoint: Path, tmp_path: Path) -> None:
    compiled = runner.invoke(app, ["compile", "--model", str(tiny_checkpoint), "--height", "32", "--width", "48",
                                   "--refs", "2", "--steps", "1", "--compile-cache", str(tmp_path), "--json"])
    assert compiled.exit_code == 0, compiled.stderr[-2000:]
    report = json.loads(compiled.stdout)
    assert report["references"] == ["48x32", "48x32"]  # printed WIDTHxHEIGHT; --refs reads HEIGHTxWIDTH
    assert "vae_encode_32x48" in {p["name"] for p in report["programs"]}

    timed = runner.invoke(app, ["bench", "--model", str(tiny_checkpoint), "--height", "64", "--width", "64",
                                "--refs", "96x64", "--steps", "1", "--reps", "1", "--dtype", "fp32", "--no-store",
                                "--json"])
    assert timed.exit_code == 0, timed.stderr[-2000:]
    assert json.loads(timed.stdout)["references"] == ["64x96"]
