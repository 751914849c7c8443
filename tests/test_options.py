"""Option types built once (cli/options.py): choices come from core/choices.py, aliases from the registry."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli import options
from flux2klein_cli.cli.app import app
from flux2klein_cli.core import choices
from flux2klein_cli.core.hub.registry import MODELS

runner = CliRunner()


def help_text(*args: str) -> str:
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.replace("│", " ").split())


def test_enums_are_the_core_lists() -> None:
    assert [m.value for m in options.Dtype] == list(choices.DTYPES)
    assert [m.value for m in options.Effort] == list(choices.EFFORTS)
    assert [m.value for m in options.Layout] == list(choices.LAYOUTS)
    assert [m.value for m in options.Phase] == list(choices.PHASES)


@pytest.mark.parametrize("command", ["generate", "edit", "inspect", "fetch", "parity", "bench", "compile"])
def test_model_help_lists_every_registry_alias(command: str) -> None:
    text = help_text(command)
    for alias in MODELS:
        assert alias in text, (command, alias)


@pytest.mark.parametrize(("args", "message"), [
    (["convert", "x", "--dtype", "fp8"], "unknown dtype 'fp8': use one of bf16, fp32"),
    (["convert", "x", "--layout", "zarr"], "unknown layout 'zarr': use one of flat, orbax"),
    (["bench", "--phase", "warm"], "unknown phase 'warm': use one of pipeline, ttfi, load, transformer-compile, "
                                   "steps, lora, decode"),
    (["generate", "x", "--effort", "max"], "--effort must be one of default, fast, got 'max'"),
    (["compile", "--cache-dir", "a", "--compile-cache", "b"], "--cache-dir is the old name of --compile-cache: "
                                                              "give one"),
])
def test_bad_choices_are_the_core_messages(args: list[str], message: str, tmp_path: Path) -> None:
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 2 and result.stdout == ""
    assert " ".join(result.stderr.split()) == f"error: {message}"


def test_compile_cache_is_one_name_and_the_old_one_is_hidden() -> None:
    text = help_text("compile")
    assert "--compile-cache" in text and "--cache-dir" not in text
    for command in ("generate", "edit", "bench"):
        assert "--compile-cache" in help_text(command)
