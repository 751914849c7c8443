"""The long-lived engine: many shapes in one process, batches of plans, calls from threads."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from flux2klein_cli.core.engine.engine import Engine, EngineOptions
from flux2klein_cli.core.engine.plan import RunFields
from flux2klein_cli.core.errors import FieldError

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    store = tmp_path_factory.mktemp("engine-store")
    warnings: list[str] = []
    options = EngineOptions(model=str(tiny_checkpoint), dtype="fp32", compile_cache=store)
    return Engine.load(options, tiny_checkpoint, warn=warnings.append)


def _fields(prompt: str = "a red fox", **kw: object) -> RunFields:
    return RunFields(prompts=(prompt,), steps=2, max_sequence_length=16, **kw)  # type: ignore[arg-type]


def test_alternating_shapes_compile_each_once(engine: Engine) -> None:
    a = engine.plan(_fields(height=32, width=32))
    b = engine.plan(_fields(height=48, width=32))
    engine.run(a)
    engine.run(b)
    compiled, loaded = engine.stats.programs_compiled, engine.stats.programs_loaded
    assert compiled + loaded > 0
    for plan in (a, b, a, b, a):
        run = engine.run(plan)
        assert run.executables == []  # kept from the shape's first run
        assert run.images.shape == (1, plan.height, plan.width, 3)
    assert (engine.stats.programs_compiled, engine.stats.programs_loaded) == (compiled, loaded)
    assert engine.stats.shapes_kept >= 2 and engine.stats.executable_bytes > 0


def test_a_batch_of_plans_gives_each_plan_its_own_images(engine: Engine) -> None:
    first = engine.plan(_fields("a red fox", height=32, width=32, seed=3))
    second = engine.plan(_fields("a lighthouse", height=32, width=32, seed=11))
    together = engine.run_batch([first, second])
    alone = [engine.run(first), engine.run(second)]
    for batch_run, single in zip(together, alone, strict=True):
        assert batch_run.seeds == single.seeds
        # float32: the same image within a rounding step, whichever batch it ran in
        assert np.abs(batch_run.images.astype(int) - single.images.astype(int)).max() <= 1
    assert not np.array_equal(together[0].images, together[1].images)


def test_plans_of_different_shapes_do_not_batch(engine: Engine) -> None:
    with pytest.raises(ValueError, match="batch key"):
        engine.run_batch([engine.plan(_fields(height=32, width=32)), engine.plan(_fields(height=48, width=32))])


def test_calls_from_several_threads_give_the_sequential_results(engine: Engine) -> None:
    plans = [engine.plan(_fields(height=32, width=32, seed=s)) for s in range(4)]
    expected = [engine.run(p).images for p in plans]
    got: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        got[i] = engine.run(plans[i]).images

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i in range(4):
        np.testing.assert_array_equal(got[i], expected[i])


@pytest.mark.parametrize("fields, field", [
    (dict(steps=0), "steps"), (dict(height=40, width=32), "height"), (dict(guidance=float("inf")), "guidance"),
    (dict(seed=-1), "seed"), (dict(num_images=0), "num_images"), (dict(kv=True), "kv"),
    (dict(max_sequence_length=10**9), "max_sequence_length"),
])
def test_bad_fields_name_the_field(engine: Engine, fields: dict[str, object], field: str) -> None:
    with pytest.raises(FieldError) as caught:
        engine.plan(RunFields(prompts=("x",), **fields))  # type: ignore[arg-type]
    assert caught.value.field == field and str(caught.value).startswith(field)


def test_the_first_runs_programs_load_while_the_weights_do(engine: Engine, tiny_checkpoint: Path) -> None:
    """`ahead`: the first run's executables come from a thread started before the weights were
    read; the run then waits for nothing, says the phases a run says, reports what the store did,
    and gives the images a plain engine gives."""
    plan_fields = _fields(height=32, width=32, seed=5)
    # The module's engine stores these programs (a run with progress: the loop in several calls).
    plain = engine.run(engine.plan(plan_fields), on_step=lambda done, steps: None)
    options = engine.options
    ahead = Engine.load(options, tiny_checkpoint, warn=lambda message: None,
                        ahead=[engine.plan(plan_fields)], progress=True)
    plan = ahead.plan(plan_fields)
    shape = plan.shape(ahead.pipeline.dtype, run_steps_per_call(plan))
    assert ahead.executables.ahead(shape)  # started during the load, not taken yet
    phases: list[str] = []
    run = ahead.run(plan, on_step=lambda done, steps: None, on_phase=phases.append)
    assert run.executables and {record["status"] for record in run.executables} == {"hit"}
    assert phases[-1].startswith("generating")
    np.testing.assert_array_equal(run.images, plain.images)
    assert not ahead.executables.ahead(shape)


def run_steps_per_call(plan: object) -> int | None:
    from flux2klein_cli.core.engine.engine import batch_run

    return batch_run([plan], None, True)[1]  # type: ignore[list-item]


def test_a_failed_load_says_nothing_after_it(tiny_checkpoint: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The first run's programs load on a thread of their own (`ahead`); when the weights fail to
    load, that thread goes on to its end, and what it warns then reaches no caller (it came out
    under the next command of a process running several, as the tests do)."""
    import shutil

    from flux2klein_cli.core.compile.attach import StoredExecutables
    from flux2klein_cli.core.errors import CheckpointError

    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    weights = next((broken / "vae").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    failed = threading.Event()

    def slow_store(self: object, shape: object) -> object:
        failed.wait(timeout=60)  # the store answers only after the load has failed
        raise OSError("store gone")

    monkeypatch.setattr(StoredExecutables, "for_run", slow_store)
    said: list[str] = []
    options = EngineOptions(model=str(broken), dtype="fp32", compile_cache=tmp_path / "store")
    plan_fields = _fields(height=32, width=32)
    facts_engine = Engine.load(options, tiny_checkpoint, warn=said.append)  # a plan for the broken copy's shapes
    with pytest.raises(CheckpointError):
        Engine.load(options, broken, warn=said.append, ahead=[facts_engine.plan(plan_fields)])
    failed.set()
    for thread in threading.enumerate():
        if thread.name == "flux2klein-programs":
            thread.join(timeout=60)
    assert said == []
