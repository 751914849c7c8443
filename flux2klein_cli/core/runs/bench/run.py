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
        """Every rule between the options, before anything is loaded (exit 2)."""
        from flux2klein_cli.core import limits
        from flux2klein_cli.core.choices import check_dtype, check_effort
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
        for name, value in (("height", self.height), ("width", self.width)):  # the model's multiple once it is known
            if value is not None:
                limits.check_int(name, value, limits.LIMITS.size_multiple, limits.LIMITS.max_side, "px")
        if self.batch < 1 or self.reps < 1 or (self.steps is not None and self.steps < 1):
            raise UserInputError("{field:batch}, {field:reps} and {field:steps} must be at least 1")
        # The limits table's bounds, as build_shape applies them to compile's shape (--bs is num_images).
        if self.steps is not None:
            limits.check_steps(self.steps)
        limits.check_images(self.batch)
        if self.height is not None and self.width is not None:  # the pixel count; the multiple comes later
            limits.check_size(self.height, self.width, multiple=1)
        if self.kv and (self.phase != "pipeline" or not self.reference_sizes()):
            raise FieldError("kv", f"times edits: use it with {{field:phase}} pipeline and {{field:refs}} "
                             f"1..{MAX_REFERENCES}")
        store_fields = [field(name) for name in ("compile_cache", "no_save", "effort") if given[name]]
        if not self.store and store_fields:
            raise FieldError("no_store", f"uses no executable store: drop {' and '.join(store_fields)}")


def _quiet(message: str) -> AbstractContextManager[Any]:
    return nullcontext()


def run_bench(opts: BenchOptions, *, note: Callable[[str], None] = lambda m: None,
              progress: Callable[[str], None] | None = None, warn: Callable[[str], None] | None = None,
              busy: Callable[[str], AbstractContextManager[Any]] = _quiet) -> dict[str, Any]:
    """Check `opts`, time its phase, and return the report. `note` says what is left out,
    `progress` (None: quiet) what is being timed, `busy(message)` wraps a long measurement
    (a spinner), `warn` gets the executable store's warnings."""
    opts.check()
    from flux2klein_cli.core.choices import jax_dtype

    target = jax_dtype(opts.dtype)
    if opts.phase == "transformer-compile":  # abstract shapes: no checkpoint to resolve
        from flux2klein_cli.core.runs.bench.transformer_compile import bench_transformer_compile

        return bench_transformer_compile(opts.model, height=opts.height, width=opts.width, batch=opts.batch,
                                         reps=opts.reps, unrolled=opts.unrolled, log=progress)
    if opts.phase == "pipeline" and opts.tpu and not _on_tpu_host(opts.tpu):
        from flux2klein_cli.core.runs.bench.plan import bench_without_slice

        with busy(f"compiling {opts.model} for {opts.tpu}"):
            result = bench_without_slice(opts.model, tpu=opts.tpu, height=opts.height, width=opts.width,
                                         batch=opts.batch, steps=opts.steps, references=opts.reference_sizes(),
                                         kv=opts.kv, dtype=opts.dtype, compile_cache=opts.compile_cache,
                                         save=opts.save and opts.store, effort=opts.effort, warn=warn)
        return dict(model=opts.model, phase=opts.phase, dtype=opts.dtype, **result)
    from flux2klein_cli.core.devices.runtime import configure_jax
    from flux2klein_cli.core.hub.components import resolve_composed

    if opts.phase in ("steps", "decode", "pipeline"):  # timed in this process
        configure_jax()
    if opts.phase == "pipeline":  # the mesh before the model: its checks come first
        return _pipeline(opts, target, warn, busy)
    path = resolve_composed(opts.model, opts.transformer, opts.vae)
    if opts.phase == "load":
        from flux2klein_cli.core.runs.bench.load import bench_load, load_kinds

        result = bench_load(path, convert=True, dtype=opts.dtype, reps=opts.reps, kinds=load_kinds(note),
                            log=progress)
        return dict(phase=opts.phase, **result)
    if opts.phase == "lora":
        from flux2klein_cli.core.runs.bench.lora import bench_lora, parse_ranks

        result = bench_lora(path, ranks=parse_ranks(opts.ranks or DEFAULT_RANKS), dtype=opts.dtype, reps=opts.reps,
                            log=progress)
        return dict(phase=opts.phase, **result)
    if opts.phase == "steps":  # what a progress bar costs the denoising loop
        from flux2klein_cli.core.runs.bench.steps import bench_steps

        with busy(f"timing the denoising loop of {opts.model}"):
            result = bench_steps(path, height=opts.height, width=opts.width, steps=opts.steps or STEPS_PHASE_STEPS,
                                 reps=opts.reps, dtype=opts.dtype, per_call=(1, 2), compile_cache=opts.compile_cache)
    elif opts.phase == "decode":
        from flux2klein_cli.core.runs.bench.decode import bench_decode

        result = bench_decode(path, height=opts.height, width=opts.width, batch=opts.batch, reps=opts.reps,
                              dtype=target, log=progress)
    else:  # ttfi
        from flux2klein_cli.core.hub.registry import sampling
        from flux2klein_cli.core.runs.bench.ttfi import bench_ttfi

        with busy(f"timing first images of {opts.model}"):
            ttfi = sampling(distilled=True, steps=opts.steps)  # timed as the distilled models run
            result = bench_ttfi(path, height=opts.height, width=opts.width, steps=ttfi.steps,
                                guidance=ttfi.guidance, reps=opts.reps, dtype=opts.dtype, diffusers=opts.diffusers)
        return dict(model=opts.model, phase=opts.phase, **result)
    return dict(model=opts.model, phase=opts.phase, dtype=opts.dtype, **result)


def _pipeline(opts: BenchOptions, target: Any, warn: Callable[[str], None] | None,
              busy: Callable[[str], AbstractContextManager[Any]]) -> dict[str, Any]:
    from dataclasses import replace

    from flux2klein_cli.core.compile.specs import configs_from_snapshot
    from flux2klein_cli.core.devices.distributed import DeviceOptions, run_mesh
    from flux2klein_cli.core.engine.cost import check_mesh
    from flux2klein_cli.core.engine.plan import build_plan, model_facts
    from flux2klein_cli.core.hub.components import resolve_composed
    from flux2klein_cli.core.runs.bench.pipeline import bench_fields, bench_pipeline

    run_on = run_mesh(DeviceOptions(mesh=opts.mesh, tpu=opts.tpu))
    path = resolve_composed(opts.model, opts.transformer, opts.vae)
    check_mesh(run_on, configs_from_snapshot(path).transformer)
    fields = bench_fields(opts.batch, opts.height, opts.width, opts.steps, opts.reference_sizes())
    build_plan(replace(fields, kv=opts.kv), model_facts(opts.model, model_dir=path))  # type: ignore[arg-type]
    with busy(f"benchmarking {opts.model}"):
        result = bench_pipeline(path, height=opts.height, width=opts.width, batch=opts.batch, steps=opts.steps,
                                reps=opts.reps, dtype=opts.dtype, references=opts.reference_sizes(), kv=opts.kv,
                                mesh=run_on, store=opts.store, compile_cache=opts.compile_cache, save=opts.save,
                                effort=opts.effort, warn=warn, lora=list(opts.lora))
    return dict(model=opts.model, phase=opts.phase, dtype=opts.dtype, **result)


def _on_tpu_host(tpu: str) -> bool:
    """A host with TPU chips runs the timed phases (run_mesh checks it is the named slice);
    any other compiles for the slice and reports what it can."""
    from flux2klein_cli.core.devices.tpu import parse_preset, tpu_chips_present

    parse_preset(tpu)
    return tpu_chips_present()
