"""What `flux2klein bench` does: its options, checked once, and the phase they name, run.

Each phase's measurement lives in its own module of this package (lora's in core/lora/); this
one picks it, hands it what it reads, and adds what every report carries (model, phase, dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flux2klein_cli.core.choices import check_phase
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.engine.engine import EngineOptions
from flux2klein_cli.core.engine.plan import ModelFacts, RunPlan
from flux2klein_cli.core.errors import FieldError, UserInputError, field
from flux2klein_cli.core.hub.registry import DEFAULT_MODEL

# Options only some phases use, by phase (as fields); given with another phase they are exit 2.
PHASE_FIELDS: dict[str, tuple[str, ...]] = {
    "ttfi": ("diffusers",),
    "pipeline": ("mesh", "tpu", "compile_cache", "no_save", "effort", "no_store", "lora", "refs"),
    "lora": ("ranks",),
}
DEFAULT_RANKS = "16,64"
STEPS_PHASE_STEPS = 8  # `--phase steps` without --steps: enough steps for a bar's cost per step to show


@dataclass(frozen=True)
class BenchOptions:
    model: str = DEFAULT_MODEL
    phase: str = "pipeline"
    height: int = DEFAULTS.side
    width: int = DEFAULTS.side
    batch: int = 1
    steps: int | None = None
    reps: int = 3
    dtype: str = "bf16"
    refs: str | None = None  # --refs: a count at the output size, or sizes "512x512,768x1024"
    kv: bool = False
    mesh: str | None = None
    tpu: str | None = None
    unrolled: bool = False
    diffusers: bool = False
    compile_cache: Path | None = None
    effort: str = "default"
    save: bool = True  # store newly compiled executables (--no-save: False)
    store: bool = True  # use the executable store at all (--no-store: False)
    lora: tuple[str, ...] = ()
    ranks: str | None = None
    transformer: str | None = None
    vae: str | None = None

    def given(self) -> dict[str, bool]:
        """The phase-specific options given, by field."""
        return {"diffusers": self.diffusers, "mesh": bool(self.mesh), "tpu": bool(self.tpu),
                "compile_cache": self.compile_cache is not None, "no_save": not self.save,
                "effort": self.effort != "default", "no_store": not self.store, "lora": bool(self.lora),
                "ranks": self.ranks is not None, "refs": bool(self.reference_sizes())}

    def reference_sizes(self) -> tuple[tuple[int, int], ...]:
        """(height, width) of each reference of the timed edit; () for text to image."""
        from flux2klein_cli.core.pipeline.references import parse_refs

        return parse_refs(self.refs, self.height, self.width)

    def check(self) -> None:
        """Every rule between the options, before anything is loaded (exit 2); the sizes, steps
        and images too when the model's configs are here (else once it is resolved)."""
        from flux2klein_cli.core.choices import check_dtype, check_effort
        from flux2klein_cli.core.engine.plan import model_facts
        from flux2klein_cli.core.pipeline.references import MAX_REFERENCES

        check_phase(self.phase)
        check_dtype(self.dtype)
        check_effort(self.effort)
        given = self.given()
        for only, names in PHASE_FIELDS.items():
            wrong = [field(name) for name in names if given[name]] if self.phase != only else []
            if wrong:
                raise UserInputError(f"{' and '.join(wrong)}: only with {{field:phase}} {only}")
        if self.diffusers:
            from flux2klein_cli.core.extras import require_parity

            require_parity("bench --diffusers")
        if self.batch < 1 or self.reps < 1 or (self.steps is not None and self.steps < 1):
            raise UserInputError("{field:batch}, {field:reps} and {field:steps} must be at least 1")
        if self.kv and (self.phase != "pipeline" or not self.reference_sizes()):
            raise FieldError("kv", f"times edits: use it with {{field:phase}} pipeline and {{field:refs}} "
                             f"1..{MAX_REFERENCES}")
        store_fields = [field(name) for name in ("compile_cache", "no_save", "effort") if given[name]]
        if not self.store and store_fields:
            raise FieldError("no_store", f"uses no executable store: drop {' and '.join(store_fields)}")
        facts = model_facts(self.model, transformer=self.transformer, vae=self.vae)
        if facts is not None:
            self.planned(facts)

    def planned(self, facts: ModelFacts) -> RunPlan:
        """The timed run without its pixels, by the plan's rules (`--bs` is its images): what
        `compile` checks of the same shape, and the model's defaults applied."""
        from flux2klein_cli.core.engine.plan import shape_plan

        return shape_plan(facts, height=self.height, width=self.width, steps=self.steps, batch=self.batch,
                          references=self.reference_sizes(), kv=self.kv)


def _quiet(message: str) -> AbstractContextManager[Any]:
    return nullcontext()


def run_bench(opts: BenchOptions, *, note: Callable[[str], None] = lambda m: None,
              progress: Callable[[str], None] | None = None, warn: Callable[[str], None] | None = None,
              busy: Callable[[str], AbstractContextManager[Any]] = _quiet) -> dict[str, Any]:
    """Check `opts`, time its phase, and return the report. `note` says what is left out,
    `progress` (None: quiet) what is being timed, `busy(message)` wraps a long measurement
    (a spinner), `warn` gets the executable store's warnings."""
    opts.check()
    return {"model": opts.model, "phase": opts.phase, "dtype": opts.dtype, **_measure(opts, note, progress, warn, busy)}


def _measure(opts: BenchOptions, note: Callable[[str], None], progress: Callable[[str], None] | None,
             warn: Callable[[str], None] | None, busy: Callable[[str], AbstractContextManager[Any]]) -> dict[str, Any]:
    if opts.phase == "transformer-compile":  # abstract shapes: no checkpoint to resolve
        from flux2klein_cli.core.runs.bench.transformer_compile import bench_transformer_compile

        return bench_transformer_compile(opts.model, height=opts.height, width=opts.width, batch=opts.batch,
                                         reps=opts.reps, unrolled=opts.unrolled, log=progress)
    if opts.phase == "pipeline" and opts.tpu and not _on_tpu_host(opts.tpu):
        from flux2klein_cli.core.runs.bench.plan import bench_without_slice

        with busy(f"compiling {opts.model} for {opts.tpu}"):
            return bench_without_slice(opts.model, tpu=opts.tpu, height=opts.height, width=opts.width,
                                       batch=opts.batch, steps=opts.steps, references=opts.reference_sizes(),
                                       kv=opts.kv, dtype=opts.dtype, compile_cache=opts.compile_cache,
                                       save=opts.save and opts.store, effort=opts.effort, warn=warn)
    from flux2klein_cli.core.devices.runtime import configure_jax

    if opts.phase in ("steps", "pipeline", "decode"):  # timed in this process
        configure_jax()
    if opts.phase in ("steps", "pipeline"):  # on an engine, opened as generate opens one
        return _on_engine(opts, warn or (lambda message: None), busy)
    from flux2klein_cli.core.engine.plan import model_facts
    from flux2klein_cli.core.hub.components import resolve_composed

    path = resolve_composed(opts.model, opts.transformer, opts.vae)
    planned = opts.planned(model_facts(opts.model, model_dir=path))  # type: ignore[arg-type]
    if opts.phase == "load":
        from flux2klein_cli.core.runs.bench.load import bench_load, load_kinds

        return bench_load(path, convert=True, dtype=opts.dtype, reps=opts.reps, kinds=load_kinds(note), log=progress)
    if opts.phase == "lora":
        from flux2klein_cli.core.runs.bench.lora import bench_lora, parse_ranks

        return bench_lora(path, ranks=parse_ranks(opts.ranks or DEFAULT_RANKS), dtype=opts.dtype, reps=opts.reps,
                          log=progress)
    if opts.phase == "decode":
        from flux2klein_cli.core.choices import jax_dtype
        from flux2klein_cli.core.runs.bench.decode import bench_decode

        return bench_decode(path, height=planned.height, width=planned.width, batch=opts.batch, reps=opts.reps,
                            dtype=jax_dtype(opts.dtype), log=progress)
    from flux2klein_cli.core.runs.bench.ttfi import bench_ttfi

    with busy(f"timing first images of {opts.model}"):  # the run generate plans for these options
        return bench_ttfi(path, height=planned.height, width=planned.width, steps=planned.steps,
                          guidance=planned.guidance, reps=opts.reps, dtype=opts.dtype, diffusers=opts.diffusers)


def _on_engine(opts: BenchOptions, warn: Callable[[str], None],
               busy: Callable[[str], AbstractContextManager[Any]]) -> dict[str, Any]:
    """The pipeline and steps phases: the engine opened with every check generate runs (options,
    paths, the plan, the mesh, what this host holds), then timed."""
    from dataclasses import replace

    from flux2klein_cli.core.devices.distributed import DeviceOptions
    from flux2klein_cli.core.engine.opening import Opening
    from flux2klein_cli.core.engine.plan import build_plan
    from flux2klein_cli.core.hub.snapshot import resolve_model
    from flux2klein_cli.core.runs.bench.pipeline import bench_fields, bench_pipeline
    from flux2klein_cli.core.runs.bench.steps import bench_steps

    options = EngineOptions(model=opts.model, dtype=opts.dtype, devices=DeviceOptions(mesh=opts.mesh, tpu=opts.tpu),
                            compile_cache=opts.compile_cache, save_executables=opts.save, effort=opts.effort,
                            transformer=opts.transformer, vae=opts.vae, lora=opts.lora, store=opts.store)
    steps = opts.steps or (STEPS_PHASE_STEPS if opts.phase == "steps" else None)
    fields = bench_fields(opts.batch, opts.height, opts.width, steps, opts.reference_sizes())
    opening = Opening(options, resolve_model, lambda facts: build_plan(replace(fields, kv=opts.kv), facts))
    opening.admitted(warn)
    if opts.phase == "steps":  # what a progress bar costs the denoising loop
        with busy(f"timing the denoising loop of {opts.model}"):
            return bench_steps(opening.load(warn), opening.planned, reps=opts.reps, per_call=(1, 2))
    with busy(f"benchmarking {opts.model}"):
        return bench_pipeline(opening, fields, reps=opts.reps, kv=opts.kv, warn=warn)


def _on_tpu_host(tpu: str) -> bool:
    """A host with TPU chips runs the timed phases (run_mesh checks it is the named slice);
    any other compiles for the slice and reports what it can."""
    from flux2klein_cli.core.devices.tpu import parse_preset, tpu_chips_present

    parse_preset(tpu)
    return tpu_chips_present()
