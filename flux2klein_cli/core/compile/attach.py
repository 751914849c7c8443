"""Stored executables for `generate`, `edit` and `bench`: the programs a request needs, built
from the model's configs exactly as `flux2klein compile` builds them (same names, shapes,
dtypes, shardings, so the same store keys), loaded when stored, compiled in parallel and
stored when not. The pipeline then calls the executables themselves: nothing is traced or
compiled during the run, and a call whose arguments do not fit an executable falls back
to jit with a warning instead of using it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from flux2klein_cli.core.compile.compile_all import compile_all
from flux2klein_cli.core.compile.model_configs import ModelConfigs, configs_from_snapshot
from flux2klein_cli.core.compile.specs import pipeline_programs
from flux2klein_cli.core.compile.store import ExecutableStore
from flux2klein_cli.core.compile.target import Target
from flux2klein_cli.core.pipeline.programs import RunShape

LOADING_PHASE = "loading or compiling programs"


class StoredExecutables:
    def __init__(self, model_dir: str | Path, store: ExecutableStore, *, mesh: Mesh | None = None, save: bool = True,
                 progress: Callable[[str], None] | None = None, effort: str = "default"):
        self.configs: ModelConfigs = configs_from_snapshot(model_dir)
        self.store, self.save, self.progress = store, save, progress
        target = Target(mesh) if mesh is not None else Target.local()
        self.target = dataclasses.replace(target, effort=effort)
        self.report: list[dict[str, Any]] = []
        self._phases: tuple[Callable[[str], None], str] | None = None

    @contextmanager
    def announcing(self, on_phase: Callable[[str], None], then: str) -> Iterator[None]:
        """While in: a load of a run's executables says `loading or compiling programs` as it
        starts and `then` (the run's next phase) as it ends."""
        self._phases = (on_phase, then)
        try:
            yield
        finally:
            self._phases = None

    def for_run(self, run: RunShape) -> dict[str, jax.stages.Compiled]:
        phases, self._phases = self._phases, None  # once per run
        if phases is not None:
            phases[0](LOADING_PHASE)
        try:
            specs = pipeline_programs(self.configs, run, self.target)
            results = compile_all(specs, self.store, parallel=True, save=self.save, progress=self.progress)
        finally:
            if phases is not None:
                phases[0](phases[1])
        self.report = [info.as_dict() for _, info in results]
        return {spec.name: compiled for spec, (compiled, _) in zip(specs, results, strict=True)
                if compiled is not None}
