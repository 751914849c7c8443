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

from flux2klein_cli import __version__
from flux2klein_cli.core import limits
from flux2klein_cli.core.choices import jax_dtype
from flux2klein_cli.core.devices.distributed import is_writer, run_mesh
from flux2klein_cli.core.engine.engine import Engine, EngineOptions, ImageRun, check_engine_options, composing
from flux2klein_cli.core.engine.plan import ModelFacts, RunFields, RunPlan, build_plan, model_facts
from flux2klein_cli.core.errors import FieldError, Flux2KleinError, UserInputError
from flux2klein_cli.core.hub.checkpoint import Snapshot
from flux2klein_cli.core.paths import check_name_length
from flux2klein_cli.core.runs.image_files import plan_outputs, write_png
from flux2klein_cli.core.runs.run_cost import check_run_fits


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
        raise UserInputError("no prompt given: pass PROMPT or --prompt-file")
    return prompts


def _check_paths(opts: GenerateOptions) -> None:
    """Every path the run reads or writes fits the filesystem's limits (before any of them is used)."""
    engine, fields = opts.engine, opts.fields
    check_name_length(engine.model, "--model")
    check_name_length(opts.output, "--output")
    for path in fields.references:
        check_name_length(path, "reference image")
    for path, what in ((fields.latents, "--latents"), (engine.kv_cache_dir, "--kv-cache-dir"),
                       (engine.compile_cache, "--compile-cache")):
        if path is not None:
            check_name_length(path, what)


def partly_written(error: Flux2KleinError, written: list[Path], total: int) -> Flux2KleinError:
    """A write that failed midway: the images already written stay (each is complete), and the
    error names them, in its message and as `.written` for `--json`."""
    if written:
        names = ", ".join(str(p) for p in written)
        error = type(error)(f"{error}; {len(written)} of {total} images were written: {names}")
    error.written = [str(p) for p in written]  # type: ignore[attr-defined]
    return error


def check_kv_model(snapshot: Snapshot, model: str) -> None:
    """--kv needs a KV-trained transformer: other checkpoints were never taught cached references."""
    if not snapshot.kv:
        raise UserInputError(
            f"--kv needs a KV-trained checkpoint (Flux2KleinKVPipeline); {model} is {snapshot.pipeline_class}: "
            "use --model 9b-kv, or drop --kv"
        )


def check_cost(model_dir: Path, plan: RunPlan, dtype_name: str, mesh: Any, warn: Callable[[str], None]) -> None:
    """The memory estimate against the device, and a word on long runs; before loading."""
    from flux2klein_cli.core.runs import run_cost
    from flux2klein_cli.core.weights.configs import read_config

    snapshot = Snapshot.open(model_dir)
    configs = {name: read_config(snapshot.component(name)) for name in ("transformer", "text_encoder", "vae")}
    geometry = plan.geometry
    image_tokens = geometry.tokens(plan.height, plan.width)
    ref_tokens = sum(geometry.tokens(h, w) for h, w in plan.reference_sizes)
    passes = 2 if plan.cfg else 1  # CFG: a second, negative pass
    item = 4 if dtype_name == "fp32" else 2
    cost = run_cost.RunCost(
        parameter_bytes=run_cost.parameter_bytes(configs, jax_dtype(dtype_name)),
        activation_bytes_per_image=passes * run_cost.activation_bytes(
            configs["transformer"], image_tokens, plan.max_sequence_length, ref_tokens, item,
            scores=run_cost.materialises_scores(item)),
        batch=plan.batch, token_steps=image_tokens * plan.steps * plan.batch * passes,
    )
    if mesh is None:  # a mesh spreads both over its devices; its own checks apply
        run_cost.check_fits(cost, *run_cost.device_memory_bytes())
    message = run_cost.describe_long_run(cost)
    if message:
        warn(message)


def png_metadata(plan: RunPlan, run: ImageRun, index: int, options: EngineOptions,
                 lora: list[dict[str, Any]]) -> dict[str, Any]:
    """The parameters image `index` of a run carries in its PNG (`generate --from` reads them back)."""
    return dict(
        prompt=plan.prompts[index // plan.num_images],
        negative_prompt=plan.negative_prompt if run.cfg else "",
        seed=run.seeds[index] if plan.latents is None else f"latents:{plan.latents_name}",
        steps=plan.steps, guidance=plan.guidance, size=f"{plan.width}x{plan.height}", model=options.model,
        **options.components, references=list(plan.reference_names), dtype=options.dtype,
        version=__version__, **({"lora": lora} if lora else {}), **init_metadata(plan),
        # What else decides the pixels, so that `--from` reruns the image exactly.
        max_sequence_length=plan.max_sequence_length, **({"kv": True} if plan.kv else {}),
        **({"reference_max_area": plan.reference_max_area} if plan.reference_names else {}),
    )


def init_metadata(plan: RunPlan) -> dict[str, Any]:
    """An image-to-image or inpainting run's init image, mask and strength (none without them)."""
    if plan.init_image_name is None:
        return {}
    mask = {"mask": plan.mask_name} if plan.mask_name is not None else {}
    crop = {"padding_mask_crop": plan.padding_mask_crop} if plan.padding_mask_crop is not None else {}
    return {"init_image": plan.init_image_name, **mask, "strength": plan.strength, **crop}


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

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        components = out.pop("components")
        out.update(components)  # `transformer` / `vae` at the top level, as given
        return out


def resolve_facts(options: EngineOptions, resolve: Callable[[str], Path],
                  on_phase: Callable[[str], None]) -> tuple[ModelFacts, Path | None]:
    """The model's facts before any download when its configs are here, else after resolving it."""
    facts = model_facts(options.model, transformer=options.transformer, vae=options.vae)
    if facts is not None:
        return facts, None
    on_phase("loading model")
    model_dir = resolve(options.model)
    return model_facts(options.model, model_dir=model_dir), model_dir  # type: ignore[return-value]


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
    _check_paths(opts)
    options = opts.engine
    check_engine_options(options)
    if options.kv_cache_dir is not None and not opts.fields.kv:
        raise FieldError("kv_cache_dir", "needs {field:kv}")
    resolve = composing(options, resolve)
    facts, model_dir = resolve_facts(options, resolve, on_phase)
    plan = build_plan(opts.fields, facts)
    outputs = plan_outputs(opts.output, plan.batch, force=opts.force)

    on_phase("loading model")
    if model_dir is None:
        model_dir = resolve(options.model)
    resolved = model_facts(options.model, model_dir=model_dir)
    if resolved != facts:  # the registry's geometry or kind was not this snapshot's
        plan = build_plan(opts.fields, resolved)  # type: ignore[arg-type]
    mesh = run_mesh(options.devices)
    check_run_fits(mesh, model_dir, plan.batch)
    check_cost(model_dir, plan, options.dtype, mesh, warn)
    load_start = time.perf_counter()
    engine = Engine.load(options, model_dir, mesh=mesh, warn=warn)
    load_seconds = time.perf_counter() - load_start

    run = engine.run(plan, on_step=on_step, on_phase=on_phase)  # says "loading or compiling programs", "generating"

    on_phase("writing")
    write_start = time.perf_counter()
    writer = is_writer()
    written: list[Path] = []
    lora = engine.lora_records
    try:
        for i, (path, image) in enumerate(zip(outputs if writer else [], run.images, strict=False)):
            write_png(path, image, png_metadata(plan, run, i, options, lora), force=opts.force)
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
        cpu_kernels=cpu_kernels(), seconds={k: round(v, 4) for k, v in seconds.items()},
    )


def cpu_kernels() -> dict[str, str | None] | None:
    """On a CPU run (the programs trace for JAX's default backend), whether its bf16 work takes
    the AMX kernel plugin and how its dots accumulate (core/models/kernels.py); None on an accelerator."""
    import jax

    if jax.default_backend() != "cpu":
        return None
    from flux2klein_cli.core.models import kernels

    return kernels.report()
