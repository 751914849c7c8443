"""The run's programs: their names, the shape of a run (RunShape) and the jittable functions.

The pipeline calls these programs; core/compile lowers the same functions from abstract
arguments and stores the executables under the same names. A name spelled differently on
the two sides would silently turn a stored executable into a recompile, so every name comes
from here. The denoise loop, the noise draw and the references-only KV pass are in denoise.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.devices.sharding import BATCH_AXES, batch_shards, constrain
from flux2klein_cli.core.models.trace import TraceOptions, jit_program
from flux2klein_cli.core.pipeline import tokens
from flux2klein_cli.core.pipeline.geometry import LatentGeometry
from flux2klein_cli.core.pipeline.step_cache import CacheForm

# ----------------------------------------------------------------------------- names

TEXT_ENCODER = "text_encoder"
TEXT_ENCODER_NEGATIVE = "text_encoder_negative"  # the negative prompt's, batch 1, beside a batch of prompts
NOISE = "noise"
VAE_DECODE = "vae_decode"
REFERENCE_KV = "reference_kv"


def negative_text_name(prompts: int) -> str:
    """The program that encodes the negative prompt: with one prompt, the prompts' own
    (same batch of 1); else a batch-1 program of its own."""
    return TEXT_ENCODER if prompts == 1 else TEXT_ENCODER_NEGATIVE


def vae_encode_name(height: int, width: int) -> str:
    """One VAE encode program per reference size."""
    return f"vae_encode_{height}x{width}"


def denoise_count(steps: int, per_call: int | None) -> int | None:
    """Steps per denoise call; None for the whole loop in one call."""
    return None if per_call in (None, steps) else per_call


def denoise_name(count: int | None, cache: CacheForm | None = None) -> str:
    """The program's name: `denoise` for the whole loop, `denoise_by_<k>` for k steps a call,
    a step-cached loop's with its form's suffix, so each form is its own stored entry."""
    name = "denoise" if count is None else f"denoise_by_{count}"
    return name if cache is None else name + cache.suffix


# ----------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class RunShape:
    """What decides the programs of a run: output size, images, prompts, steps, references."""

    height: int
    width: int
    geometry: LatentGeometry  # the model's (ModelConfigs.geometry): token grid and latent channels
    batch: int = 1  # images per run (prompts x images per prompt)
    prompts: int = 1  # distinct prompts: the text encoder's batch
    steps: int = 4
    references: tuple[tuple[int, int], ...] = ()  # (height, width) of each reference, in order
    cfg: bool = False  # classifier-free guidance (undistilled models with guidance > 1)
    max_sequence_length: int = DEFAULTS.max_sequence_length
    dtype: Any = jnp.bfloat16
    kv: bool = False  # KV edit: a references-only pass, then denoising against its cache
    steps_per_call: int | None = None  # the denoise loop in chunks (a progress bar); None: one call
    # An init image (image-to-image, inpainting): references[0] is it, at the output size, and
    # `steps` counts the steps the loop runs (from the strength's start step on).
    init: bool = False
    mask: bool = False  # inpainting: the init image's mask blends every step
    cache: CacheForm | None = None  # a step cache's form (its numbers are the program's inputs)

    def __post_init__(self) -> None:
        """A shape no run can have is a bug of its builder: requests are checked by their plan
        (core/engine/plan.py: build_plan / build_shape), once, with messages naming fields."""
        problems = [
            (min(self.batch, self.prompts, self.max_sequence_length, self.steps) < 1,
             "batch, prompts, steps and max sequence length must be at least 1"),
            (self.kv and not self.references, "a KV edit needs reference sizes"),
            (self.batch % self.prompts != 0, f"batch {self.batch} is not a multiple of the {self.prompts} prompts"),
            (self.init and (self.kv or not self.references or self.references[0] != (self.height, self.width)),
             "an init image is the first reference, at the output size, and no KV edit"),
            (self.mask and not self.init, "a mask needs an init image"),
            (self.steps_per_call is not None and (self.steps_per_call < 1 or self.steps % self.steps_per_call != 0),
             f"steps per call {self.steps_per_call} does not divide {self.steps} steps"),
            (self.cache is not None and self.steps_per_call is not None,
             "a step-cached loop runs in one call (its cache lives in the loop)"),
        ]
        for wrong, why in problems:
            if wrong:
                raise ValueError(f"RunShape: {why}")

    @property
    def grid(self) -> tuple[int, int]:
        return self.geometry.grid(self.height, self.width)

    @property
    def reference_tokens(self) -> int:
        return sum(self.geometry.tokens(h, w) for h, w in self.references)

    @property
    def denoise_count(self) -> int | None:
        return denoise_count(self.steps, self.steps_per_call)

    def names(self) -> list[str]:
        """Every program this run calls, in the order the pipeline calls them."""
        names = [TEXT_ENCODER]
        if self.cfg and negative_text_name(self.prompts) != TEXT_ENCODER:
            names.append(TEXT_ENCODER_NEGATIVE)
        names += [NOISE, denoise_name(self.denoise_count, self.cache), VAE_DECODE]
        names += [vae_encode_name(h, w) for h, w in dict.fromkeys(self.references)]  # distinct sizes, in order
        if self.kv:
            names.append(REFERENCE_KV)
        return names


# ----------------------------------------------------------------------------- functions


def jit_module_call(module: nnx.Module, method: str | Callable[..., Any] = "__call__",
                    trace: TraceOptions | None = None) -> Callable[..., Any]:
    """jit a module method (its name, or a function of (module, *args)) as a function of
    (state, *args), so shapes alone decide recompiles; traced under `trace` (None: the local
    backend's forms)."""
    graphdef, _ = nnx.split(module)

    def call(state: nnx.State, *args: Any) -> Any:
        model = nnx.merge(graphdef, state)
        return method(model, *args) if callable(method) else getattr(model, method)(*args)

    return jit_program(call, trace)


def encode_tokens(vae: Any, pixels: jax.Array) -> jax.Array:
    """pixels (1, H, W, 3) -> the reference's packed latents (1, tokens, channels) of its LatentGeometry."""
    return tokens.pack_nhwc(vae.encode(pixels))


def decode_latents(vae: Any, latents: jax.Array) -> jax.Array:
    """The denoise loop's float32 latents (B, h, w, channels) -> images, rounded to the VAE's dtype
    first, as diffusers hands them over.

    Decoded one image per batch shard at a time (a `lax.map` over the images each device
    holds): the decoder's activations are the largest of the pipeline, so this divides its
    peak memory by the images per device, and libtpu compiles the one-image decoder in about
    half the time (docs/benchmarks.md). Each image is decoded alone either way, so the result
    is the same."""
    batch, *grid = latents.shape
    shards = batch_shards(batch)
    per_shard = batch // shards
    if per_shard == 1:
        return vae.decode(latents.astype(vae.dtype))
    # Shard s holds images [s * per_shard, (s + 1) * per_shard): row s of this view, so
    # stepping over the second axis gives every device one of its own images, no transfer.
    by_shard = constrain(latents.reshape(shards, per_shard, *grid), BATCH_AXES)
    steps = constrain(jnp.swapaxes(by_shard, 0, 1), None, BATCH_AXES)

    def decode_step(group: jax.Array) -> jax.Array:
        return vae.decode(constrain(group, BATCH_AXES).astype(vae.dtype))

    images = jax.lax.map(decode_step, steps)  # (per_shard, shards, H, W, C)
    images = constrain(jnp.swapaxes(images, 0, 1), BATCH_AXES)
    return images.reshape(batch, *images.shape[2:])
