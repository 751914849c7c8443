"""Abstract program specs for a whole run, from a model's configs alone (no weights).

The pipeline owns its programs (core/pipeline/programs.py: names, RunShape, functions);
this module only describes their arguments, so the store can compile them ahead of time.
Each spec lowers the very function the pipeline calls (`jit_module_call` of the text
encoder and of the VAE's `encode_tokens` / `decode_latents`, `denoise_fn` of the
transformer, `noise_fn`) on the very argument pytrees it passes: the same `nnx.State`
structure, shapes, dtypes and shardings, so an executable compiled here is the one a real
call needs. A program is one short function below; the denoise inputs come from the
pipeline's own builder (`denoise.build_inputs`) under `jax.eval_shape`, fed the abstract
outputs of the programs that make them, so a field added to DenoiseInputs is described once.

Shardings: on a one-device mesh the parameters carry NamedSharding(mesh, P()) as the loader
places them and the inputs none (the pipeline passes fresh host arrays). On a larger mesh
(`--tpu`, `--mesh`) every 2D+ parameter is split over the fsdp axis along its largest
divisible dimension (the layer axis of scanned stacks excepted), and every batch over
what of (data, fsdp) divides it (sharding.fitting_axes); the rest is replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flux2klein_cli.core.compile.model_configs import ModelConfigs
from flux2klein_cli.core.compile.target import ProgramSpec, Target
from flux2klein_cli.core.devices.sharding import BATCH_AXES, fitting_axes
from flux2klein_cli.core.models.layers import is_word_leaf
from flux2klein_cli.core.models.trace import TraceOptions
from flux2klein_cli.core.pipeline import programs
from flux2klein_cli.core.pipeline.denoise import (
    BATCHED_FIELDS,
    CacheRule,
    DenoiseInputs,
    build_inputs,
    denoise_fn,
    noise_fn,
    reference_kv_fn,
)
from flux2klein_cli.core.pipeline.programs import RunShape
from flux2klein_cli.core.pipeline.step_cache import StepCache

# ----------------------------------------------------------------------------- models


@dataclass
class AbstractModels:
    """The three models built from configs by `nnx.eval_shape`: graphdefs and shapes only."""

    transformer: Any
    text_encoder: Any
    vae: Any
    configs: ModelConfigs
    dtype: Any
    states: dict[str, Any] = field(default_factory=dict)  # name -> state of ShapeDtypeStructs

    @classmethod
    def build(cls, configs: ModelConfigs, dtype: Any = jnp.bfloat16) -> AbstractModels:
        from flux2klein_cli.core.models.quantized import prequantize_abstract, quantize_abstract
        from flux2klein_cli.core.models.qwen3 import Qwen3Config, abstract_text_encoder
        from flux2klein_cli.core.models.transformer import TransformerConfig, abstract_transformer
        from flux2klein_cli.core.models.vae import VAEConfig, abstract_vae

        # Built as the loaders build them (load_transformer, load_qwen3, load_vae).
        tcfg = TransformerConfig.from_dict(configs.transformer)
        qcfg = Qwen3Config.from_dict(configs.text_encoder)
        forms = {tuple(path.split(".")): form for path, form in configs.prequantized}
        return cls(
            transformer=prequantize_abstract(quantize_abstract(abstract_transformer(tcfg, dtype=dtype),
                                                               configs.quantize), forms),
            text_encoder=quantize_abstract(abstract_text_encoder(qcfg, dtype=dtype), configs.quantize),
            vae=abstract_vae(VAEConfig.from_dict(configs.vae), dtype=dtype),
            configs=configs, dtype=dtype,
        )

    def state(self, name: str, mesh: Mesh) -> Any:
        """The module's state as ShapeDtypeStructs placed as the loader places them on `mesh`
        (core/devices/sharding.py's rules; the VAE replicated)."""
        from flux2klein_cli.core.devices.sharding import model_rule, replicated_rule

        rule = model_rule(mesh) if mesh.size > 1 and name != "vae" else replicated_rule

        platform = mesh.devices.flat[0].platform

        def place(path: tuple[Any, ...], var: Any) -> Any:
            leaf = var.get_value()
            sharding = NamedSharding(mesh, rule(tuple(path), tuple(leaf.shape)))
            # as the pipeline passes it: on CPU, stacked bf16 weights as words (models/layers.py)
            dtype = jnp.uint16 if name != "vae" and is_word_leaf(tuple(path), leaf.dtype, platform) else leaf.dtype
            return path, var.replace(jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding))

        flat = nnx.to_flat_state(nnx.state(getattr(self, name)))
        return nnx.from_flat_state([place(path, var) for path, var in flat])


def param_bytes_per_device(state: Any) -> int:
    """Bytes of a placed abstract state on one device (its shard of every leaf)."""
    total = 0
    for leaf in jax.tree.leaves(state):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


# ----------------------------------------------------------------------------- inputs


def _input(shape: tuple[int, ...], dtype: Any, mesh: Mesh, *, batched: bool = True) -> jax.ShapeDtypeStruct:
    """An input array: none on one device (a fresh host array), else the batch split as the
    pipeline splits it (sharding.batch_spec) and replicated otherwise."""
    if not _explicit(mesh):
        return jax.ShapeDtypeStruct(shape, dtype)
    axes = fitting_axes(mesh, shape[0], BATCH_AXES) if batched and shape else None
    spec = PartitionSpec() if axes is None else PartitionSpec(axes)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _explicit(mesh: Mesh) -> bool:
    """Inputs carry shardings except on one local device, where the pipeline passes plain arrays."""
    return mesh.size > 1 or mesh.devices.flat[0] not in jax.local_devices()


def denoise_fields(models: AbstractModels, run: RunShape, mesh: Mesh) -> dict[str, Any]:
    """Every DenoiseInputs field the pipeline fills for this run, as ShapeDtypeStructs: the
    pipeline's own builder (denoise.build_inputs) under `jax.eval_shape`, fed the abstract
    outputs of the very programs that make them (the text encoder's as the model states it,
    VAE encode, noise, the references-only pass), then placed as the pipeline places them."""
    from flux2klein_cli.core.pipeline.schedule import SchedulerConfig, make_schedule

    grid, t = run.grid, run.max_sequence_length
    trace = None  # shapes only: any platform's forms give the same

    def text_features(prompts: int) -> Any:
        return models.text_encoder.features_shape(prompts, t)

    references, grids, kv = None, [], None
    if run.kv:  # references enter as their cached K / V, not as tokens
        kv = reference_kv_shapes(models, run, mesh)
    elif run.references:
        encode = programs.jit_module_call(models.vae, programs.encode_tokens, trace)
        parts = [jax.eval_shape(encode, models.states["vae"],
                                jax.ShapeDtypeStruct((1, *size, models.vae.config.in_channels), models.dtype))
                 for size in run.references]
        references = parts[0] if len(parts) == 1 else jax.eval_shape(
            lambda *xs: jnp.concatenate(xs, axis=1), *parts)  # the pipeline joins them on the host
        grids = [run.geometry.grid(*size) for size in run.references]
    noise = jax.eval_shape(noise_fn(run.geometry.channels, *grid), jax.ShapeDtypeStruct((run.batch,), jnp.uint32))
    mask = jax.ShapeDtypeStruct(grid, jnp.float32) if run.mask else None
    schedule = make_schedule(run.steps, grid[0] * grid[1], SchedulerConfig())  # the lengths are the steps run

    def build(text: Any, negative: Any, references: Any, kv: Any, noise: Any, mask: Any) -> DenoiseInputs:
        return build_inputs(models.transformer.rope, grid, latents=noise, text=text, negative_text=negative,
                            references=references, reference_grids=grids, reference_kv=kv, schedule=schedule,
                            guidance=1.0, init=run.init, noise=noise if run.mask else None, mask=mask,
                            cache_rule=None if run.cache is None else CacheRule.of(StepCache.with_form(run.cache)))

    inputs = jax.eval_shape(build, text_features(run.prompts), text_features(1) if run.cfg else None, references,
                            kv, noise, mask)
    return {f.name: _place(getattr(inputs, f.name), mesh, f.name in BATCHED_FIELDS)
            for f in dataclasses.fields(DenoiseInputs)}


def _place(value: Any, mesh: Mesh, batched: bool) -> Any:
    """Abstract values placed as the pipeline's arrays are (`_input`)."""
    return jax.tree.map(lambda x: _input(tuple(x.shape), x.dtype, mesh, batched=batched), value)


def denoise_inputs(fields: dict[str, Any]) -> Any:
    """A DenoiseInputs of ShapeDtypeStructs; fields not given (e.g. a future optional one) are None."""
    names = [f.name for f in dataclasses.fields(DenoiseInputs)]
    unknown = set(fields) - set(names)
    if unknown:
        raise ValueError(f"DenoiseInputs has no field(s) {sorted(unknown)}")
    return DenoiseInputs(**{name: fields.get(name) for name in names})


# ----------------------------------------------------------------------------- programs


def _key(models: AbstractModels, component: str, target: Target, **extra: Any) -> dict[str, Any]:
    quantize = {"quantize": models.configs.quantize} if models.configs.quantize and component != "vae" else {}
    if models.configs.prequantized and component == "transformer":
        quantize["prequantized"] = [list(pair) for pair in models.configs.prequantized]
    return {"config": getattr(models.configs, component), "dtype": jnp.dtype(models.dtype).name,
            "geometry": models.configs.geometry.as_key(), "trace": trace_options(target).as_key(), **quantize,
            **extra}


def trace_options(target: Target) -> TraceOptions:
    """The forms the target's programs are traced in (the backend dispatch's rule for its platform
    and effort: a TPU target gets the TPU kernel from any host). Part of each program's key."""
    return TraceOptions.for_platform(target.platform, effort=target.effort)


def text_encoder_program(models: AbstractModels, target: Target, prompts: int, length: int,
                         name: str = programs.TEXT_ENCODER) -> ProgramSpec:
    """pipeline.encode_text: ids and mask (prompts, length) int32."""
    mesh = target.mesh
    ids = _input((prompts, length), jnp.int32, mesh)
    return ProgramSpec(name, programs.jit_module_call(models.text_encoder, trace=trace_options(target)),
                       (models.states["text_encoder"], ids, ids),
                       _key(models, "text_encoder", target, feature_layers=list(models.text_encoder.feature_layers)),
                       target, model="text_encoder")


def denoise_program(models: AbstractModels, target: Target, run: RunShape) -> ProgramSpec:
    """pipeline's denoise loop: denoise_fn(transformer graphdef, steps per call)(state,
    DenoiseInputs, start step int32); all steps in one call unless run.steps_per_call."""
    inputs = denoise_inputs(denoise_fields(models, run, target.mesh))
    start = _input((), jnp.int32, target.mesh, batched=False)
    count = run.denoise_count
    fn = denoise_fn(nnx.split(models.transformer)[0], count, trace_options(target), run.cache)
    cache = {} if run.cache is None else {"step_cache": run.cache.as_key()}
    return ProgramSpec(programs.denoise_name(count, run.cache), fn, (models.states["transformer"], inputs, start),
                       _key(models, "transformer", target, steps_per_call=count, **cache), target, model="transformer")


def _reference_kv_args(models: AbstractModels, run: RunShape, mesh: Mesh) -> tuple[Any, ...]:
    """pipeline.reference_kv's pass: refs (1, R, C) float32 as encode_references gives them,
    and RoPE over the reference ids only."""
    from flux2klein_cli.core.models.transformer import TransformerConfig

    cfg = TransformerConfig.from_dict(models.configs.transformer)
    r = run.reference_tokens
    refs = _input((1, r, cfg.in_channels), jnp.float32, mesh, batched=False)
    rope = _input((r, cfg.attention_head_dim), jnp.float32, mesh, batched=False)
    return models.states["transformer"], refs, rope, rope


def reference_kv_shapes(models: AbstractModels, run: RunShape, mesh: Mesh) -> Any:
    """The ReferenceKV the references-only pass returns, as ShapeDtypeStructs (traced, not compiled)."""
    fn = reference_kv_fn(nnx.split(models.transformer)[0])
    return jax.eval_shape(fn, *_reference_kv_args(models, run, mesh))


def reference_kv_program(models: AbstractModels, target: Target, run: RunShape) -> ProgramSpec:
    """pipeline.reference_kv's references-only pass: reference_kv_fn(graphdef)(state, refs, cos, sin)."""
    fn = reference_kv_fn(nnx.split(models.transformer)[0], trace_options(target))
    return ProgramSpec(programs.REFERENCE_KV, fn, _reference_kv_args(models, run, target.mesh),
                       _key(models, "transformer", target), target, model="transformer")


def vae_decode_program(models: AbstractModels, target: Target, run: RunShape) -> ProgramSpec:
    """pipeline's decode: the denoise loop's latents (B, h, w, patched channels), float32."""
    h, w = run.grid
    latents = _input((run.batch, h, w, models.vae.config.patched_channels), jnp.float32, target.mesh)
    decode = programs.jit_module_call(models.vae, programs.decode_latents, trace_options(target))
    return ProgramSpec(programs.VAE_DECODE, decode,
                       (models.states["vae"], latents), _key(models, "vae", target), target, model="vae")


def vae_encode_program(models: AbstractModels, target: Target, size: tuple[int, int]) -> ProgramSpec:
    """pipeline.encode_references, one reference at its own size: (1, H, W, 3) in the model dtype."""
    pixels = _input((1, *size, models.vae.config.in_channels), models.dtype, target.mesh)
    encode = programs.jit_module_call(models.vae, programs.encode_tokens, trace_options(target))
    return ProgramSpec(programs.vae_encode_name(*size), encode, (models.states["vae"], pixels),
                       _key(models, "vae", target), target, model="vae")


def noise_program(target: Target, run: RunShape) -> ProgramSpec:
    """pipeline.noise: seeds (B,) uint32 -> (B, h, w, channels) float32 noise."""
    seeds = _input((run.batch,), jnp.uint32, target.mesh, batched=False)
    # The output shape is not in the arguments: the key must name it.
    channels = run.geometry.channels
    return ProgramSpec(programs.NOISE, noise_fn(channels, *run.grid), (seeds,),
                       {"shapes": {"channels": channels, "grid": list(run.grid)}, "geometry": run.geometry.as_key()},
                       target)


def pipeline_programs(configs: ModelConfigs, run: RunShape, target: Target | None = None,
                      models: AbstractModels | None = None) -> list[ProgramSpec]:
    """Every program a run needs (RunShape.names): text encoder (and the negative prompt's,
    batch 1, with CFG), noise, denoise loop, VAE decode, a VAE encode per distinct reference
    size, and the references-only pass of a KV edit."""
    target = target or Target.local()
    if run.geometry != configs.geometry:
        raise ValueError(f"run geometry {run.geometry} is not the model's {configs.geometry}")
    models = models or AbstractModels.build(configs, run.dtype)
    for name in ("transformer", "text_encoder", "vae"):
        models.states[name] = models.state(name, target.mesh)
    length = run.max_sequence_length
    encodes = {programs.vae_encode_name(*size): size for size in run.references}
    builders: dict[str, Callable[[], ProgramSpec]] = {
        programs.TEXT_ENCODER: lambda: text_encoder_program(models, target, run.prompts, length),
        programs.TEXT_ENCODER_NEGATIVE: lambda: text_encoder_program(
            models, target, 1, length, name=programs.TEXT_ENCODER_NEGATIVE),
        programs.NOISE: lambda: noise_program(target, run),
        programs.denoise_name(run.denoise_count, run.cache): lambda: denoise_program(models, target, run),
        programs.VAE_DECODE: lambda: vae_decode_program(models, target, run),
        programs.REFERENCE_KV: lambda: reference_kv_program(models, target, run),
    }
    # RunShape.names is the one list of a run's programs, in the pipeline's order.
    return [builders[name]() if name in builders else vae_encode_program(models, target, encodes[name])
            for name in run.names()]


def resident_bytes(programs: list[ProgramSpec]) -> dict[str, int]:
    """Per device: the parameter bytes of each model the programs read (all stay loaded)."""
    out: dict[str, int] = {}
    for spec in programs:
        if spec.model and spec.model not in out:
            out[spec.model] = param_bytes_per_device(spec.args[0])
    return out
