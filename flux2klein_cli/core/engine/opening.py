"""Opening an engine, the one way every door (generate / edit, batch, serve) does it.

Everything that can fail before the weights load fails first, cheapest first: the engine's
options (dtype, effort, devices, LoRA files, path lengths, the KV store), then the door's plans
against the model's facts (from its configs, before any download when they are here). `resolve`
then finds the model (downloading it if need be), plans again if the snapshot's facts are not
the ones planned against, makes the mesh, checks the transformer fits it, and gives the
`Admission` every plan must pass before any device work (core/engine/cost.py). Only `load`
reads weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from flux2klein_cli.core.engine.cost import Admission, check_mesh
from flux2klein_cli.core.engine.engine import Engine, EngineOptions, Warn
from flux2klein_cli.core.engine.plan import ModelFacts, check_kv_model, model_facts
from flux2klein_cli.core.errors import FieldError

T = TypeVar("T")
Phase = Callable[[str], None]


def check_engine_options(options: EngineOptions) -> None:
    """What an engine's options must satisfy before anything loads (a missing LoRA fails here)."""
    from flux2klein_cli.core.choices import check_dtype, check_effort
    from flux2klein_cli.core.lora.files import LoraSpec, resolve_lora
    from flux2klein_cli.core.paths import check_name_length

    check_name_length(options.model, "model")
    for path, name in ((options.kv_cache_dir, "kv_cache_dir"), (options.compile_cache, "compile_cache")):
        if path is not None:
            check_name_length(path, name)
    check_effort(options.effort)
    check_dtype(options.dtype)
    options.devices.check()
    for text in options.lora:
        resolve_lora(LoraSpec.parse(text))
    names = [name for name, _ in options.lora_sets]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise FieldError("lora_set", f"names a set twice: {', '.join(twice)}")
    for name, specs in options.lora_sets:
        for text in specs:
            try:
                resolve_lora(LoraSpec.parse(text))
            except FieldError as e:
                raise FieldError("lora_set", f"{name}: {e.detail}") from None


def composing(options: EngineOptions, resolve: Callable[[str], Path]) -> Callable[[str], Path]:
    """`resolve`, composing the transformer / VAE from elsewhere into the snapshot when given."""
    if not (options.transformer or options.vae):
        return resolve
    from flux2klein_cli.core.hub.components import compose, resolve_overrides

    sources = resolve_overrides(options.transformer, options.vae)
    return lambda model: compose(resolve(model), sources)


def _no_plans(facts: ModelFacts) -> None:
    return None


class Opening(Generic[T]):
    """An engine on its way: `planned` is what the door's `plan(facts)` gave, made again
    whenever the facts change; `resolve()` then `load()`."""

    def __init__(self, options: EngineOptions, resolve: Callable[[str], Path],
                 plan: Callable[[ModelFacts], T] = _no_plans, *, on_phase: Phase = lambda phase: None):  # type: ignore[assignment]
        check_engine_options(options)
        self.options, self._plan, self._on_phase = options, plan, on_phase
        self._resolve = composing(options, resolve)
        self.model_dir: Path | None = None
        facts = model_facts(options.model, transformer=options.transformer, vae=options.vae)
        if facts is None:  # only the snapshot tells: resolve it now
            on_phase("loading model")
            self.model_dir = self._resolve(options.model)
            facts = model_facts(options.model, model_dir=self.model_dir)
        self.facts: ModelFacts = facts  # type: ignore[assignment]
        check_kv_model(self.facts, "kv_cache_dir" if options.kv_cache_dir is not None else None)
        self.planned: T = plan(self.facts)
        self.mesh: Any = None
        self.admission: Admission | None = None

    def resolve(self) -> Admission:
        """The model on disk (downloaded if need be), the plans again if its facts are not the
        ones planned against, the mesh, and what this host admits."""
        from flux2klein_cli.core.compile.model_configs import configs_from_snapshot
        from flux2klein_cli.core.devices.distributed import run_mesh

        if self.admission is not None:
            return self.admission
        self._on_phase("loading model")
        self._back_abstract_builds()
        if self.model_dir is None:
            self.model_dir = self._resolve(self.options.model)
        configs = configs_from_snapshot(self.model_dir)
        facts = ModelFacts.of(self.options.model, configs)
        if facts != self.facts:  # the registry's geometry or kind was not this snapshot's
            self.facts = facts
            check_kv_model(facts, "kv_cache_dir" if self.options.kv_cache_dir is not None else None)
            self.planned = self._plan(facts)
        self.mesh = run_mesh(self.options.devices)
        check_mesh(self.mesh, configs.transformer)
        self.admission = Admission(configs, self.options.dtype, self.mesh)
        return self.admission

    def _back_abstract_builds(self) -> None:
        """The models' abstract builds (the admission's, the loader's, the executables') kept in the
        executable store beside its programs, when this engine uses one."""
        from flux2klein_cli.core.models.layers import back_abstract_builds

        if not self.options.store:
            back_abstract_builds(None)
            return
        from flux2klein_cli.core.compile.abstract_store import AbstractModelStore

        back_abstract_builds(AbstractModelStore(self.options.compile_cache, save=self.options.save_executables))

    def admitted(self, warn: Warn, plan_of: Callable[[T], Any] = lambda planned: planned) -> T:
        """`resolve`, then the plan (`plan_of(planned)`) refused if this host cannot hold it (a
        `FieldError`, as every door refuses) and announced if it will take long; `planned`."""
        admission = self.resolve()
        plan = plan_of(self.planned)
        admission.check(plan)
        message = admission.long_run(plan)
        if message:
            warn(message)
        return self.planned

    def load(self, warn: Warn, ahead: Sequence[Any] = (), progress: bool = False) -> Engine:
        """The engine, its weights read (after `resolve`'s checks, which it runs if not yet run);
        `ahead`, `progress`: the first run's plans, whose programs load meanwhile (Engine.load)."""
        self.resolve()
        assert self.model_dir is not None
        return Engine.load(self.options, self.model_dir, mesh=self.mesh, warn=warn, ahead=ahead, progress=progress)

