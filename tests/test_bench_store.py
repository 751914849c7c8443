"""`flux2klein bench` loads the pipeline's programs from the executable store as `generate` does:
compiled and stored on the first run, loaded on the next; `--no-save` stores nothing and
`--no-store` times plain jit compilation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app

runner = CliRunner()
PROGRAMS = {"text_encoder", "noise", "denoise", "vae_decode"}  # a text-to-image run's programs


def bench(model: Path, *extra: str) -> dict:
    args = ["bench", "--model", str(model), "--height", "32", "--width", "32", "--steps", "1", "--reps", "1",
            "--dtype", "fp32", "--json", *extra]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def entries(store: Path) -> list[Path]:
    return sorted(store.glob("*/meta.json"))


@pytest.mark.slow
def test_first_run_compiles_and_stores_then_the_second_loads(tiny_checkpoint: Path, tmp_path: Path) -> None:
    store = tmp_path / "executables"
    first = bench(tiny_checkpoint, "--compile-cache", str(store))
    assert first["store"] == {"root": str(store), "save": True, "effort": "default"}
    assert {p["name"] for p in first["executables"]} == PROGRAMS
    assert {p["name"]: p["status"] for p in first["executables"]} == dict.fromkeys(PROGRAMS, "miss")
    assert all(p["saved"] and p["seconds"] > 0 for p in first["executables"])
    assert len(entries(store)) == len(PROGRAMS)
    manifest = json.loads((store / "manifest.json").read_text())
    assert {e["name"] for e in manifest["executables"]} == PROGRAMS
    # compile_s is the first call's overhead, the store's phase included.
    extra = first["first_call"]["executables"] - first["phases"]["executables"]["median"]
    assert extra > 0 and first["compile_s"] >= extra
    assert first["timed_compiles"] == []  # the steady state holds no compilation

    second = bench(tiny_checkpoint, "--compile-cache", str(store))
    assert {p["name"]: p["status"] for p in second["executables"]} == dict.fromkeys(PROGRAMS, "hit")
    assert not any(p["saved"] for p in second["executables"])
    assert len(entries(store)) == len(PROGRAMS)
    assert second["timed_compiles"] == []


def test_no_save_leaves_the_store_empty(tiny_checkpoint: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "executables"
    monkeypatch.setenv("FLUX2KLEIN_COMPILE_CACHE", str(store))  # the default store, as for generate
    result = bench(tiny_checkpoint, "--no-save")
    assert result["store"] == {"root": str(store), "save": False, "effort": "default"}
    assert {p["name"]: p["status"] for p in result["executables"]} == dict.fromkeys(PROGRAMS, "miss")
    assert not any(p["saved"] for p in result["executables"])
    assert entries(store) == []


@pytest.mark.slow
def test_no_store_jit_compiles_and_touches_no_store(tiny_checkpoint: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "executables"
    monkeypatch.setenv("FLUX2KLEIN_COMPILE_CACHE", str(store))
    result = bench(tiny_checkpoint, "--no-store")
    assert result["store"] is None and result["executables"] is None
    assert "executables" not in result["phases"] and result["compile_s"] > 0
    assert not store.exists()


@pytest.mark.parametrize("extra, message", [
    (["--no-store", "--compile-cache", "x"], "--no-store uses no executable store: drop --compile-cache"),
    (["--no-store", "--no-save"], "--no-store uses no executable store: drop --no-save"),
    (["--phase", "ttfi", "--no-save"], "--no-save: only with --phase pipeline"),
    (["--phase", "transformer-compile", "--no-store"], "--no-store: only with --phase pipeline"),
    (["--phase", "load", "--tpu", "v6-4"], "--tpu: only with --phase pipeline"),
    (["--phase", "load", "--mesh", "fsdp=1", "--tpu", "v6-4"], "--mesh and --tpu: only with --phase pipeline"),
    (["--phase", "load", "--diffusers"], "--diffusers: only with --phase ttfi"),
    (["--phase", "steps", "--effort", "fast", "--no-store"], "--effort and --no-store: only with --phase pipeline"),
    (["--effort", "max"], "--effort must be one of default, fast, got 'max'"),
])
def test_store_flags_misused_are_exit_2(tiny_checkpoint: Path, extra: list[str], message: str) -> None:
    result = runner.invoke(app, ["bench", "--model", str(tiny_checkpoint), *extra, "--json"])
    assert result.exit_code == 2 and result.stdout == ""
    assert " ".join(result.stderr.split()) == f"error: {message}"


def test_help_names_the_store_the_default() -> None:
    result = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.stdout.replace("│", " ").split())  # rich wraps help in a box
    for flag in ("--compile-cache", "--no-save", "--no-store"):
        assert flag in text
    assert "Default: load stored executables" in text
