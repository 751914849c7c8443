"""What `generate` and `edit` do: a request's fields -> a plan -> an engine run -> PNG files and a report.

Everything that can be checked without the model (prompts, sizes, outputs, reference
images, the noise file) is checked first, by the plan (core/engine/plan.py), so bad input
fails in a second with nothing written, not after minutes of loading.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flux2klein_cli.core import limits
from flux2klein_cli.core.devices.distributed import is_writer
from flux2klein_cli.core.engine.engine import EngineOptions
from flux2klein_cli.core.engine.opening import Opening
from flux2klein_cli.core.engine.plan import ModelFacts, RunFields, RunPlan, build_plan
from flux2klein_cli.core.errors import FieldError, Flux2KleinError, UserInputError
from flux2klein_cli.core.runs import run_record
from flux2klein_cli.core.runs.image_files import write_png
from flux2klein_cli.core.runs.outputs import plan_outputs


@dataclass(frozen=True)
class GenerateOptions:
    """A `generate` / `edit` run: the engine it needs, the request, and where the images go."""

    engine: EngineOptions
    fields: RunFields
    output: Path
    force: bool = False


def read_prompts(prompt: str | None, prompt_file: Path | None) -> list[str]:
    """The positional prompt and/or one prompt per non-empty line of a file (read up to the
    limits' prompt-file size: /dev/zero is refused, not read)."""
    prompts = [prompt] if prompt is not None else []
    if prompt_file is not None:
        text = limits.read_bounded_text(prompt_file, limits.LIMITS.prompt_file_bytes, "prompt file")
        prompts += [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise FieldError("prompt", "is missing: pass it or {field:prompt_file}")
    return prompts


def partly_written(error: Flux2KleinError, written: list[Path], total: int) -> Flux2KleinError:
    """A write that failed midway: the images already written stay (each is complete), and the
    error names them, in its message and as `.written` for `--json`."""
    if written:
        names = ", ".join(str(p) for p in written)
        kind = UserInputError if isinstance(error, FieldError) else type(error)
        error = kind(f"{error.args[0]}; {len(written)} of {total} images were written: {names}")
    error.written = [str(p) for p in written]  # type: ignore[attr-defined]
    return error




@dataclass
class GenerateReport:
    """What `generate` / `edit` did: `--json` prints `as_dict()`."""

    outputs: list[str]
    seeds: list[int] | None
    model: str
    model_path: str
    height: int
    width: int
    steps: int
    guidance: float
    cfg: bool
    references: list[str]
    dtype: str
    lora: list[dict[str, Any]]
    kv: bool
    kv_cache: str | None
    mesh: dict[str, int] | None
    writer: bool
    executables: list[dict[str, Any]]
    cpu_kernels: dict[str, str | None] | None
    seconds: dict[str, float]
    components: dict[str, str] = field(default_factory=dict)
    cache: dict[str, Any] | None = None  # with a step cache: its settings and what it skipped

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        components = out.pop("components")
        out.update(components)  # `transformer` / `vae` at the top level, as given
        return out


def run_generate(
    opts: GenerateOptions,
    resolve: Callable[[str], Path],
    on_phase: Callable[[str], None] = lambda phase: None,
    warn: Callable[[str], None] = lambda message: print(f"warning: {message}", file=sys.stderr),
    on_step: Callable[[int, int], None] | None = None,
) -> GenerateReport:
    """Plan, load, run, write. `on_step(done, steps)` after each denoising step (the loop then
    runs in several calls; without it, one)."""
    start = time.perf_counter()
    options, fields = opts.engine, opts.fields
    if options.kv_cache_dir is not None and not fields.kv:
        raise FieldError("kv_cache_dir", "needs {field:kv}")

    def plan_run(facts: ModelFacts) -> tuple[RunPlan, list[Path]]:
        plan = build_plan(fields, facts)
        return plan, plan_outputs(opts.output, plan.batch, force=opts.force)

    opening = Opening(options, resolve, plan_run, on_phase=on_phase)
    plan, outputs = opening.admitted(warn, lambda planned: planned[0])
    load_start = time.perf_counter()
    engine = opening.load(warn, ahead=[plan], progress=on_step is not None)
    load_seconds = time.perf_counter() - load_start
    mesh, model_dir = opening.mesh, opening.model_dir

    run = engine.run(plan, on_step=on_step, on_phase=on_phase)  # says "loading or compiling programs", "generating"

    on_phase("writing")
    write_start = time.perf_counter()
    writer = is_writer()
    written: list[Path] = []
    lora = engine.lora_records
    try:
        for i, (path, image) in enumerate(zip(outputs if writer else [], run.images, strict=False)):
            write_png(path, image, run_record.encode(plan, i, options, lora), force=opts.force)
            written.append(path)
    except Flux2KleinError as e:
        raise partly_written(e, written, len(outputs)) from e
    seconds = dict(load=load_seconds, **run.seconds, write=time.perf_counter() - write_start)
    seconds.pop("total", None)
    seconds["total"] = time.perf_counter() - start
    return GenerateReport(
        outputs=[str(p) for p in outputs], seeds=run.seeds if plan.latents is None else None,
        model=options.model, model_path=str(model_dir), components=options.components,
        height=plan.height, width=plan.width, steps=plan.steps, guidance=plan.guidance, cfg=run.cfg,
        references=list(plan.reference_names), dtype=options.dtype, lora=lora, kv=plan.kv, kv_cache=run.kv_cache,
        mesh=None if mesh is None else dict(mesh.shape), writer=writer, executables=run.executables,
        cpu_kernels=cpu_kernels(), seconds={k: round(v, 4) for k, v in seconds.items()}, cache=run.cache,
    )


def cpu_kernels() -> dict[str, str | None] | None:
    """On a CPU run (the programs trace for JAX's default backend), whether its bf16 work takes
    the AMX kernel plugin and how its dots accumulate (core/models/kernels.py); None on an accelerator."""
    import jax

    if jax.default_backend() != "cpu":
        return None
    from flux2klein_cli.core.models import kernels

    return kernels.report()
