"""What `generate` and `edit` do, from validated options to PNG files and a report.

Everything that can be checked without the model (prompts, sizes, outputs, reference
images, the noise file) is checked first, so bad input fails in a second with nothing
written, not after minutes of loading.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flux2klein_cli import __version__
from flux2klein_cli.core.choices import check_effort, jax_dtype
from flux2klein_cli.core.devices.distributed import DeviceOptions, is_writer, run_mesh
from flux2klein_cli.core.errors import Flux2KleinError, UserInputError
from flux2klein_cli.core.hub.checkpoint import Snapshot
from flux2klein_cli.core.hub.registry import default_size, sampling
from flux2klein_cli.core.paths import check_name_length
from flux2klein_cli.core.pipeline.geometry import LatentGeometry, check_steps
from flux2klein_cli.core.pipeline.pipeline import Request, check_seeds
from flux2klein_cli.core.pipeline.references import check_reference_count
from flux2klein_cli.core.runs.image_files import load_latents, plan_outputs, write_png
from flux2klein_cli.core.runs.images import (
    load_reference,
    postprocess,
    preprocess_reference,
    validate_size,
)
from flux2klein_cli.core.runs.run_cost import check_run_fits


@dataclass
class GenerateOptions:
    model: str
    prompts: list[str]
    output: Path
    references: list[Path] = field(default_factory=list)
    height: int | None = None
    width: int | None = None
    steps: int | None = None  # None: the model's default (4 distilled, 50 base)
    guidance: float | None = None  # None: the model's default (1.0 distilled, 4.0 base)
    negative_prompt: str = ""
    seed: int = 0
    num_images: int = 1
    dtype: str = "bf16"
    latents: Path | None = None
    force: bool = False
    max_sequence_length: int = 512
    kv: bool = False  # reference KV cache (edit --kv)
    kv_cache_dir: Path | None = None  # keep reference KV caches here across runs
    devices: DeviceOptions = field(default_factory=DeviceOptions)
    compile_cache: Path | None = None  # the executable store [default: FLUX2KLEIN_COMPILE_CACHE or the user cache]
    save_executables: bool = True  # --no-save: use stored executables, store nothing new
    effort: str = "default"  # XLA optimisation effort of compiled executables (compile.target.EFFORTS)
    transformer: str | None = None  # --transformer: the transformer from elsewhere (core/hub/components.py)
    vae: str | None = None  # --vae
    lora: list[str] = field(default_factory=list)  # --lora PATH_OR_REPO[:SCALE], merged at load


def read_prompts(prompt: str | None, prompt_file: Path | None) -> list[str]:
    """The positional prompt and/or one prompt per non-empty line of a file."""
    prompts = [prompt] if prompt is not None else []
    if prompt_file is not None:
        try:
            # utf-8-sig: a BOM (Windows editors write one) is not part of the first prompt.
            lines = prompt_file.read_text(encoding="utf-8-sig").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UserInputError(f"{prompt_file}: cannot read prompt file ({e})") from None
        prompts += [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise UserInputError("no prompt given: pass PROMPT or --prompt-file")
    if any(not p.strip() for p in prompts):
        raise UserInputError("empty prompt: give the image a description")
    return prompts


def _check_paths(opts: GenerateOptions) -> None:
    """Every path the run reads or writes fits the filesystem's limits (before any of them is used)."""
    check_name_length(opts.model, "--model")
    check_name_length(opts.output, "--output")
    for path in opts.references:
        check_name_length(path, "reference image")
    for path, what in ((opts.latents, "--latents"), (opts.kv_cache_dir, "--kv-cache-dir"),
                       (opts.compile_cache, "--compile-cache")):
        if path is not None:
            check_name_length(path, what)


def _check_options(opts: GenerateOptions) -> None:
    _check_paths(opts)
    if opts.steps is not None:
        check_steps(opts.steps)
    if opts.num_images < 1:
        raise UserInputError(f"--num-images must be at least 1, got {opts.num_images}")
    if opts.guidance is not None and opts.guidance < 0:
        raise UserInputError(f"--guidance must not be negative, got {opts.guidance}")
    if opts.seed < 0:
        raise UserInputError(f"--seed must not be negative, got {opts.seed}")
    check_seeds(opts.seed, len(opts.prompts) * opts.num_images)
    if opts.max_sequence_length < 1:
        raise UserInputError("--max-sequence-length must be at least 1")
    check_reference_count(len(opts.references))
    if opts.kv and not opts.references:
        raise UserInputError("--kv needs at least one reference image (--image)")
    if opts.kv_cache_dir is not None and not opts.kv:
        raise UserInputError("--kv-cache-dir needs --kv")
    opts.devices.check()
    from flux2klein_cli.core.lora.files import LoraSpec, resolve_lora

    for text in opts.lora:  # a missing LoRA fails before anything loads
        resolve_lora(LoraSpec.parse(text))


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


def _check_cost(snapshot: Snapshot, opts: GenerateOptions, dtype: Any, height: int, width: int,
                references: list[Any], steps: int, guidance: float, batch: int, mesh: Any,
                pixels_per_token: int, warn: Callable[[str], None]) -> None:
    """The size limit, the memory estimate against the device, and a word on long runs; before loading."""
    from flux2klein_cli.core.runs import run_cost
    from flux2klein_cli.core.weights.configs import read_config

    configs = {name: read_config(snapshot.component(name)) for name in ("transformer", "text_encoder", "vae")}
    run_cost.check_size_limit(height, width, configs["transformer"], pixels_per_token)
    image_tokens = (height // pixels_per_token) * (width // pixels_per_token)
    ref_tokens = sum((r.shape[0] // pixels_per_token) * (r.shape[1] // pixels_per_token) for r in references)
    passes = 2 if not snapshot.is_distilled and guidance > 1.0 else 1  # CFG: a second, negative pass
    item = 4 if opts.dtype == "fp32" else 2
    cost = run_cost.RunCost(
        parameter_bytes=run_cost.parameter_bytes(configs, dtype),
        activation_bytes_per_image=passes * run_cost.activation_bytes(
            configs["transformer"], image_tokens, opts.max_sequence_length, ref_tokens, item,
            scores=run_cost.materialises_scores(item)),
        batch=batch, token_steps=image_tokens * steps * batch * passes,
    )
    if mesh is None:  # a mesh spreads both over its devices; its own checks apply
        run_cost.check_fits(cost, *run_cost.device_memory_bytes())
    message = run_cost.describe_long_run(cost)
    if message:
        warn(message)


def model_geometry(model: str) -> LatentGeometry | None:
    """The model's latent geometry from its configs alone, when they are here (a local or cached
    snapshot, `tiny`, or a published alias); None when only a download would tell."""
    from flux2klein_cli.core.compile.specs import model_configs

    try:
        configs = model_configs(model)
    except Flux2KleinError:
        return None  # resolve() says what is wrong, or downloads it
    return configs.geometry


def _component_sources(opts: GenerateOptions) -> dict[str, str]:
    """The overridden components' sources, as given, for PNG metadata and --json."""
    return {name: value for name, value in (("transformer", opts.transformer), ("vae", opts.vae)) if value}


def run_generate(
    opts: GenerateOptions,
    resolve: Callable[[str], Path],
    on_phase: Callable[[str], None] = lambda phase: None,
    warn: Callable[[str], None] = lambda message: print(f"warning: {message}", file=sys.stderr),
    on_step: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Validate, load, run, write. Returns the report that `--json` prints. `on_step(done,
    steps)` after each denoising step (the loop then runs in several calls; without it, one)."""
    start = time.perf_counter()
    _check_options(opts)
    dtype = jax_dtype(opts.dtype)

    check_effort(opts.effort)
    # Sizes, references and --latents depend on the model's geometry: checked before any
    # download when the configs are here, else right after resolving, before the weights load.
    if opts.transformer or opts.vae:
        from flux2klein_cli.core.hub.components import compose, resolve_overrides

        sources, plain = resolve_overrides(opts.transformer, opts.vae), resolve

        def resolve(model: str) -> Path:
            return compose(plain(model), sources)
    geometry = None if opts.vae else model_geometry(opts.model)
    model_dir = None
    if geometry is None:
        on_phase("loading model")
        model_dir = resolve(opts.model)
        geometry = LatentGeometry.of_snapshot(model_dir)
    multiple = geometry.pixels_per_token
    validate_size(opts.height, opts.width, multiple_of=multiple)
    references = [preprocess_reference(load_reference(path), multiple_of=multiple) for path in opts.references]
    side = default_size(opts.model)
    first = references[0].shape[:2] if references else (side, side)
    height, width = opts.height or int(first[0]), opts.width or int(first[1])
    validate_size(height, width, multiple_of=multiple)
    batch = len(opts.prompts) * opts.num_images
    outputs = plan_outputs(opts.output, batch, force=opts.force)
    noise = None
    if opts.latents is not None:
        noise = load_latents(opts.latents, geometry.latents_shape(batch, height, width))

    on_phase("loading model")
    if model_dir is None:
        model_dir = resolve(opts.model)
    snapshot = Snapshot.open(model_dir)
    if opts.kv:
        check_kv_model(snapshot, opts.model)
    mesh = run_mesh(opts.devices)
    check_run_fits(mesh, model_dir, batch)
    chosen = sampling(snapshot.is_distilled, opts.steps, opts.guidance)
    steps, guidance = chosen.steps, chosen.guidance
    _check_cost(snapshot, opts, dtype, height, width, references, steps, guidance, batch, mesh,
                geometry.pixels_per_token, warn)
    load_start = time.perf_counter()
    from flux2klein_cli.core.lora.files import LoraSpec
    from flux2klein_cli.core.pipeline.pipeline import KleinPipeline

    pipeline = KleinPipeline.load(model_dir, dtype=dtype, mesh=mesh, lora=[LoraSpec.parse(t) for t in opts.lora])
    loras = pipeline.lora.records() if pipeline.lora else []
    load_seconds = time.perf_counter() - load_start
    from flux2klein_cli.core.compile.attach import StoredExecutables
    from flux2klein_cli.core.compile.store import ExecutableStore

    pipeline.warn = warn
    pipeline.executables = StoredExecutables(model_dir, ExecutableStore(opts.compile_cache, on_warning=warn),
                                             mesh=mesh, save=opts.save_executables,
                                             effort=opts.effort)
    if opts.kv_cache_dir is not None:
        from flux2klein_cli.core.compile.keys import code_fingerprint
        from flux2klein_cli.core.pipeline.kv_store import ReferenceKVStore, cache_identity

        identity = cache_identity(snapshot.component("transformer"), snapshot.component("vae"), code_fingerprint())
        if pipeline.lora:  # merged LoRAs change the reference K / V
            identity = f"{identity}+lora:{pipeline.lora.identity()}"
        pipeline.kv_store = ReferenceKVStore(opts.kv_cache_dir, identity, dtype, warn)

    on_phase(f"generating {batch} image(s), {steps} steps")
    request = Request(
        prompts=opts.prompts, steps=steps, guidance=guidance, height=height, width=width,
        num_images=opts.num_images, negative_prompt=opts.negative_prompt, seed=opts.seed, latents=noise,
        references=references, max_sequence_length=opts.max_sequence_length, kv=opts.kv,
    )
    try:
        result = pipeline(request, on_step=on_step)
    except Exception as e:  # a device that still runs out: one line, exit 1
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        raise Flux2KleinError(f"the device ran out of memory for {batch} image(s) of {width}x{height}; "
                              "try fewer --num-images or a smaller size") from None
    images = postprocess(result.images)

    on_phase("writing")
    write_start = time.perf_counter()
    writer = is_writer()
    written: list[Path] = []
    try:
        for i, (path, image) in enumerate(zip(outputs if writer else [], images, strict=False)):
            write_png(path, image, dict(
                prompt=opts.prompts[i // opts.num_images],
                negative_prompt=opts.negative_prompt if result.guidance_used else "",
                seed=result.seeds[i] if noise is None else f"latents:{opts.latents}",
                steps=steps, guidance=guidance, size=f"{width}x{height}", model=opts.model,
                **_component_sources(opts), references=[str(p) for p in opts.references], dtype=opts.dtype,
                version=__version__, **({"lora": loras} if loras else {}),
            ), force=opts.force)
            written.append(path)
    except Flux2KleinError as e:
        raise partly_written(e, written, len(outputs)) from e
    seconds = dict(load=load_seconds, **result.seconds, write=time.perf_counter() - write_start)
    seconds["total"] = time.perf_counter() - start
    return dict(
        outputs=[str(p) for p in outputs],
        seeds=result.seeds if noise is None else None,
        model=opts.model, model_path=str(model_dir), **_component_sources(opts),
        height=height, width=width, steps=steps, guidance=guidance,
        cfg=result.guidance_used, references=[str(p) for p in opts.references], dtype=opts.dtype, lora=loras,
        kv=opts.kv, kv_cache=result.kv_cache, mesh=None if mesh is None else dict(mesh.shape), writer=writer,
        executables=pipeline.executables.report, cpu_kernels=_cpu_kernels(),
        seconds={k: round(v, 4) for k, v in seconds.items()},
    )


def _cpu_kernels() -> dict[str, str | None] | None:
    """On a CPU run (the programs trace for JAX's default backend), whether its bf16 work takes
    the oneMKL kernels (core/models/cpu_matmul.py); None on an accelerator."""
    import jax

    if jax.default_backend() != "cpu":
        return None
    from flux2klein_cli.core.models import cpu_matmul

    return cpu_matmul.report()
