"""Progress: the denoising loop reports each step, gives the same images with and without a
bar, keeps its stored executables, and draws a bar only for a person (a terminal, no --json)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli import progress
from flux2klein_cli.cli.app import app
from flux2klein_cli.core.pipeline.denoise import steps_per_call
from flux2klein_cli.core.pipeline.geometry import LatentGeometry

runner = CliRunner()
SMALL = ["--height", "32", "--width", "32", "--max-sequence-length", "16", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path):
    from tests.fixtures.engine import engine_on

    return engine_on(tiny_checkpoint)


def _plan(engine, steps: int):
    from flux2klein_cli.core.engine.plan import RunFields

    return engine.plan(RunFields(prompts=("a fox",), steps=steps, height=32, width=32, max_sequence_length=16,
                                 num_images=2))


def test_steps_per_call_divides_the_steps() -> None:
    assert [steps_per_call(s, 50) for s in (4, 50, 100, 120, 7)] == [1, 1, 2, 2, 1]
    assert steps_per_call(12, 5) == 2  # 12 / 5 -> at most 2, a divisor of 12


@pytest.mark.parametrize("steps", [1, 3, 4])
def test_each_step_is_reported_once_in_order_and_the_images_are_bitwise_the_same(engine, steps: int) -> None:
    plain = engine.run(_plan(engine, steps)).images
    seen: list[tuple[int, int]] = []
    with_bar = engine.run(_plan(engine, steps), on_step=lambda done, total: seen.append((done, total))).images
    assert seen == [(i, steps) for i in range(1, steps + 1)]
    np.testing.assert_array_equal(with_bar, plain)


def test_chunked_loop_gives_the_same_latents_as_one_call(engine) -> None:
    """Several steps a call (as with many steps) still report each chunk and change nothing."""
    plain = engine.run(_plan(engine, 4)).images
    seen: list[int] = []
    chunked = engine.run(_plan(engine, 4), on_step=lambda done, total: seen.append(done), steps_per_call=2).images
    assert seen == [2, 4]
    np.testing.assert_array_equal(chunked, plain)


@pytest.mark.slow
def test_stored_executables_load_and_serve_the_stepped_loop(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """With a bar the loop's program is stored and loaded like every other (no host callback
    in it), and the run calls that executable, not a jitted fallback."""
    from tests.fixtures.engine import engine_on

    def fresh():
        return engine_on(tiny_checkpoint, store=True, compile_cache=tmp_path, warn=warnings.append)

    warnings: list[str] = []
    seen: list[int] = []
    engine = fresh()
    first = engine.run(_plan(engine, 2), on_step=lambda done, total: seen.append(done))
    second_engine = fresh()
    second = second_engine.run(_plan(second_engine, 2), on_step=lambda done, total: seen.append(done))
    statuses = {r["name"]: r["status"] for r in second.executables}
    assert statuses["denoise_by_1"] == "hit", statuses
    assert not warnings  # the stored loop fitted its call: no fallback to jit
    assert seen == [1, 2, 1, 2]
    np.testing.assert_array_equal(second.images, first.images)


def test_no_bar_under_json_or_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "_is_terminal", lambda: True)
    assert progress.wanted(as_json=False) and not progress.wanted(as_json=True)
    monkeypatch.setattr(progress, "_is_terminal", lambda: False)
    assert not progress.wanted(as_json=False)


def test_step_bar_draws_counts_and_pauses_the_spinner(monkeypatch: pytest.MonkeyPatch) -> None:
    stream, calls = io.StringIO(), []
    monkeypatch.setattr("sys.stderr", stream)
    bar = progress.StepBar(pause=lambda: calls.append("pause"), resume=lambda: calls.append("resume"))
    for done in (1, 2, 3):
        bar(done, 3)
    assert calls == ["pause", "resume"] and bar.bar is None
    assert "denoising" in stream.getvalue() and "3/3" in stream.getvalue()


@pytest.mark.slow
def test_generate_draws_the_bar_only_for_a_terminal_without_json(tiny_checkpoint: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def generate(name: str, *extra: str):
        return runner.invoke(app, ["generate", "a fox", "--model", str(tiny_checkpoint), "-o", str(tmp_path / name),
                                   "--steps", "2", *SMALL, *extra], catch_exceptions=False)

    monkeypatch.setattr(progress, "_is_terminal", lambda: False)
    piped = generate("piped.png")
    assert piped.exit_code == 0, piped.stderr
    assert "denoising" not in piped.stderr

    monkeypatch.setattr(progress, "_is_terminal", lambda: True)
    as_json = generate("json.png", "--json")
    assert as_json.exit_code == 0, as_json.stderr
    assert "denoising" not in as_json.stderr and json.loads(as_json.stdout)["steps"] == 2
    shown = generate("shown.png")
    assert shown.exit_code == 0, shown.stderr
    assert "denoising" in shown.stderr and "2/2" in shown.stderr


def test_compile_reports_each_program_once(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """compile_all's on_done counts every program, loaded or compiled, up to their number."""
    from flux2klein_cli.core.compile import specs as P
    from flux2klein_cli.core.compile.compile_all import compile_all
    from flux2klein_cli.core.compile.model_configs import model_configs
    from flux2klein_cli.core.compile.store import ExecutableStore

    run = P.RunShape(32, 32, LatentGeometry(16, 128), steps=2, max_sequence_length=16, dtype=jnp.float32)
    specs = P.pipeline_programs(model_configs(str(tiny_checkpoint)), run)
    seen: list[tuple[int, int]] = []
    for _ in range(2):  # compiled, then loaded
        seen.clear()
        compile_all(specs, ExecutableStore(tmp_path), on_done=lambda done, total: seen.append((done, total)))
        assert seen == [(i, len(specs)) for i in range(1, len(specs) + 1)]
