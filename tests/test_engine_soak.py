"""One long-lived engine: 200 runs over 4 shapes, alternated, as a server or a batch would see them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from flux2klein_cli.core.engine.engine import Engine, EngineOptions
from flux2klein_cli.core.engine.plan import RunFields

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(32, 32), (48, 32), (32, 48), (64, 32)]
RUNS = 200

# Loads each shape from the store in a new process and prints what the store did per program.
_RELOAD = """
import json, sys
from pathlib import Path
from flux2klein_cli.core.engine.engine import Engine, EngineOptions
from flux2klein_cli.core.engine.plan import RunFields
model, store = Path(sys.argv[1]), Path(sys.argv[2])
engine = Engine.load(EngineOptions(model=str(model), compile_cache=store), model, warn=print)
statuses = []
for h, w in json.loads(sys.argv[3]):
    run = engine.run(engine.plan(RunFields(prompts=("a fox",), height=h, width=w, steps=1, max_sequence_length=16)))
    statuses += [info["status"] for info in run.executables]
print(json.dumps(statuses))
"""


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_200_runs_over_4_shapes_compile_each_once_and_stay_flat(tiny_checkpoint: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    engine = Engine.load(EngineOptions(model=str(tiny_checkpoint), compile_cache=store), tiny_checkpoint,
                         warn=lambda message: None)
    plans = [engine.plan(RunFields(prompts=("a fox",), height=h, width=w, steps=1, max_sequence_length=16))
             for h, w in SHAPES]
    compiles: list[str] = []

    def on_event(event: str, duration: float, **kwargs: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        resident = {}
        for i in range(RUNS):
            before = len(compiles)
            engine.run(plans[i % len(plans)])
            if i >= len(plans):  # every shape has had its first run
                assert len(compiles) == before, f"run {i + 1} compiled {len(compiles) - before} program(s)"
            if i + 1 in (8, RUNS):
                resident[i + 1] = _resident_bytes()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert engine.stats.runs == RUNS and engine.stats.shapes_kept == len(SHAPES)
    assert resident[RUNS] <= resident[8] * 1.10, resident

    done = subprocess.run([sys.executable, "-c", _RELOAD, str(tiny_checkpoint), str(store), json.dumps(SHAPES)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    statuses = json.loads(done.stdout.strip().splitlines()[-1])
    assert statuses and set(statuses) == {"hit"}, statuses
