"""Progress says what the run is doing: `loading or compiling programs` while a shape's executables
load or compile, then `generating ...`; with --json the phases are plain lines on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.engine.engine import Engine, EngineOptions
from flux2klein_cli.core.engine.plan import RunFields

LOADING = "loading or compiling programs"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("phases-store")


@pytest.mark.slow
def test_the_engine_says_loading_then_generating(tiny_checkpoint: Path, store: Path) -> None:
    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), dtype="fp32", compile_cache=store),
                         tiny_checkpoint, warn=lambda message: None)
    fields = dict(prompts=("a fox",), steps=1, max_sequence_length=16)
    a = engine.plan(RunFields(height=32, width=48, **fields))  # type: ignore[arg-type]
    b = engine.plan(RunFields(height=32, width=32, **fields))  # type: ignore[arg-type]
    runs = []
    for plan in (a, a, b):
        phases: list[str] = []
        engine.run(plan, on_phase=phases.append)
        runs.append(phases)
    generating = "generating 1 image(s), 1 steps"
    assert runs[0] == [LOADING, generating]  # a fresh engine: its first run loads
    assert runs[1] == [generating]  # kept from the first run: nothing to load
    # Another shape once some are kept: said up front, then corrected as its programs load.
    assert runs[2] == [generating, LOADING, generating]


@pytest.mark.slow
def test_generate_json_prints_one_line_per_phase(tiny_checkpoint: Path, store: Path, tmp_path: Path) -> None:
    out = tmp_path / "fox.png"
    done = CliRunner().invoke(app, ["generate", "a fox", "--model", str(tiny_checkpoint), "--height", "32",
                                    "--width", "48", "--steps", "1", "--dtype", "fp32", "-o", str(out),
                                    "--compile-cache", str(store), "--json"])
    assert done.exit_code == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["outputs"] == [str(out)]
    phases = [line for line in done.stderr.splitlines() if not line.startswith("warning:")]
    assert phases == ["loading model", LOADING, "generating 1 image(s), 1 steps", "writing"], done.stderr
