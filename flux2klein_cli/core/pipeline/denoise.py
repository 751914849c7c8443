"""The whole denoising loop as one program: a scan over steps of transformer + Euler update.

Shapes: B images on an h x w latent grid (N = h * w image tokens), P prompts, R reference
tokens (0 for text-to-image), T text tokens, C latent channels (LatentGeometry.channels: 128
for klein). Latents stay float32 between steps (the Euler update is float32 in the reference
too); the transformer runs in its parameter dtype. Repeating prompts per image, broadcasting
references and packing the grid into tokens happen inside the program, so a run calls nothing
but its programs (and compiles nothing once they are stored).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flux2klein_cli.core.models import trace
from flux2klein_cli.core.models.trace import TraceOptions, jit_program
from flux2klein_cli.core.models.transformer import BlockInputs, Flux2Transformer, ReferenceKV, Streams
from flux2klein_cli.core.pipeline import tokens
from flux2klein_cli.core.pipeline.schedule import Schedule
from flux2klein_cli.core.pipeline.step_cache import CacheForm, StepCache


@dataclass(frozen=True)
class CacheRule:
    """A step cache's numbers, as program inputs (so trying thresholds compiles nothing new)."""

    threshold: jax.Array  # () float32
    warmup: jax.Array  # () int32
    max_skips: jax.Array  # () int32

    @classmethod
    def of(cls, cache: StepCache) -> CacheRule:
        return cls(np.float32(cache.threshold), np.int32(cache.warmup), np.int32(cache.max_skips))


@dataclass(frozen=True)
class CacheRecord:
    """What a cached loop decided, per step and transformer row (the B images, then with CFG
    the B images' negative branch): the first blocks' measured difference (inf at the first
    step: nothing to compare with) and whether the row's remaining blocks were cached."""

    difference: jax.Array  # (S, rows) float32
    cached: jax.Array  # (S, rows) bool


@dataclass(frozen=True)
class DenoiseInputs:
    latents: jax.Array  # (B, h, w, C) float32 initial noise
    text: jax.Array  # (P, T, joint) prompt features; each prompt serves B / P images, prompt-major
    negative_text: jax.Array | None  # (1, T, joint) for classifier-free guidance, else None
    references: jax.Array | None  # (1, R, C) packed reference latents (plain edit), else None
    reference_kv: ReferenceKV | None  # the references' cached K / V (KV edit), else None
    rope_cos: jax.Array  # (T + N + R, head_dim); R = 0 with reference_kv
    rope_sin: jax.Array
    timesteps: jax.Array  # (S,) float32, sigma as the transformer sees it
    sigmas: jax.Array  # (S + 1,) float32
    guidance: jax.Array  # () float32, used only with negative_text
    # Image-to-image and inpainting (an init image): its packed latents, which the first step
    # (start 0) noises to sigmas[0] in place of `latents`, else None.
    init_latents: jax.Array | None = None  # (1, N, C) float32
    # Inpainting: after each step the kept part (1 - mask) is the init latents noised to the next
    # sigma with this noise, as diffusers blends them; None without a mask.
    noise: jax.Array | None = None  # (B, h, w, C) float32, the run's initial noise
    mask: jax.Array | None = None  # (1, N, 1) float32, 1 repaint .. 0 keep, per token
    cache_rule: CacheRule | None = None  # a step cache's threshold, warm-up and cap, else None


# Fields split over the mesh's batch axes (one row per image or prompt); every other one is replicated.
BATCHED_FIELDS = frozenset({"latents", "text", "noise"})


def build_inputs(rope: Callable[[np.ndarray, np.ndarray], tuple[Any, Any]], grid: tuple[int, int], *,
                 latents: Any, text: Any, negative_text: Any, references: Any, reference_grids: list[tuple[int, int]],
                 reference_kv: Any, schedule: Schedule, guidance: float, init: bool, noise: Any, mask: Any,
                 cache_rule: CacheRule | None = None) -> DenoiseInputs:
    """A run's DenoiseInputs from its stages' outputs: the pipeline calls it with arrays, and
    compile/specs.py under `jax.eval_shape` with the stages' abstract outputs, so the stored
    programs' arguments are described once. `rope` is the transformer's table builder; the
    references' tokens (the init image's first, when `init`) are also the init latents."""
    n = grid[0] * grid[1]
    ids = np.concatenate([tokens.image_ids(*grid), tokens.reference_ids(reference_grids)])
    cos, sin = rope(tokens.text_ids(text.shape[1]), ids)
    init_latents = None
    if init:  # its tokens lead the references; a lone init image is all of them (no slice program)
        init_latents = references if references.shape[1] == n else references[:, :n]
    return DenoiseInputs(
        latents=latents, text=text, negative_text=negative_text, references=references, reference_kv=reference_kv,
        rope_cos=cos, rope_sin=sin, timesteps=np.asarray(schedule.timesteps, np.float32),
        sigmas=np.asarray(schedule.sigmas, np.float32), guidance=np.float32(guidance),
        init_latents=init_latents, noise=noise, mask=None if mask is None else _mask_tokens(mask),
        cache_rule=cache_rule,
    )


def _mask_tokens(mask: Any) -> Any:
    """(h, w) per-token mask -> (1, N, 1) float32, host or traced alike."""
    if isinstance(mask, np.ndarray):
        return np.asarray(mask, np.float32).reshape(1, -1, 1)
    return mask.astype(jnp.float32).reshape(1, -1, 1)


def denoise(model: Flux2Transformer, x: DenoiseInputs, start: jax.Array | int = 0,
            count: int | None = None, cache: CacheForm | None = None) -> Any:
    """Run `count` steps (all when None) from step `start` on `x.latents`; returns the
    (B, h, w, C) float32 latents after them. A run with a progress bar calls this several
    times, feeding each call's latents to the next; the schedule stays whole in `x`, so
    every call has the same arguments and one executable serves each chunk.

    With a step cache (`cache`, its numbers in `x.cache_rule`) the whole loop runs in one
    call, the cache's state carried by the scan, and returns (latents, CacheRecord)."""
    b, h, w, c = x.latents.shape
    steps = x.timesteps.shape[0]
    count = steps if count is None else count
    n_img = h * w
    cfg = x.negative_text is not None
    rope = (x.rope_cos, x.rope_sin)
    text = jnp.repeat(x.text, b // x.text.shape[0], axis=0)
    if cfg:  # the positive and negative branches run as one batch of 2B
        text = jnp.concatenate([text, jnp.broadcast_to(x.negative_text, text.shape)])
    references = None if x.references is None else jnp.broadcast_to(x.references, (b, *x.references.shape[1:]))

    init = None if x.init_latents is None else x.init_latents.astype(jnp.float32)
    noise = None if x.noise is None else x.noise.reshape(b, n_img, c)

    def model_tokens(latents: jax.Array) -> jax.Array:
        tokens = latents if references is None else jnp.concatenate([latents, references], axis=1)
        return jnp.concatenate([tokens, tokens]) if cfg else tokens

    def update(latents: jax.Array, velocity: jax.Array, sigma: jax.Array, sigma_next: jax.Array) -> jax.Array:
        velocity = velocity[:, :n_img]
        if cfg:
            positive, negative = jnp.split(velocity, 2)
            velocity = negative + x.guidance.astype(velocity.dtype) * (positive - negative)
        latents = latents + (sigma_next - sigma) * velocity.astype(jnp.float32)
        if x.mask is not None:  # the kept part: the init latents at the next sigma (0 after the last step)
            kept = sigma_next * noise + (1.0 - sigma_next) * init
            latents = (1.0 - x.mask) * kept + x.mask * latents
        return latents

    def step(latents: jax.Array, schedule: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        t, sigma, sigma_next = schedule
        tokens = model_tokens(latents)
        velocity = model(tokens, text, jnp.full((tokens.shape[0],), t), rope, x.reference_kv)
        return update(latents, velocity, sigma, sigma_next), None

    packed = x.latents.reshape(b, n_img, c)  # row-major grid -> tokens, as the position ids
    if init is not None:  # the first step's input: the noise (x.latents then) mixed with the init latents
        first = x.sigmas[0]
        packed = jnp.where(jnp.asarray(start) == 0, first * packed + (1.0 - first) * init, packed)
    schedule = (x.timesteps, x.sigmas[:-1], x.sigmas[1:])
    if cache is not None:
        if count != steps or x.cache_rule is None:
            raise ValueError("a step-cached loop runs every step in one call, with its CacheRule in the inputs")

        def velocity_of(tokens: jax.Array, t: jax.Array, state: _CacheState, k: jax.Array) -> Any:
            return _cached_velocity(model, cache, x.cache_rule, 2 if cfg else 1, tokens, text, t, rope,
                                    x.reference_kv, state, k)

        def cached_step(carry: tuple[jax.Array, _CacheState], scheduled: Any) -> Any:
            latents, state = carry
            k, (t, sigma, sigma_next) = scheduled
            velocity, state, record = velocity_of(model_tokens(latents), t, state, k)
            return (update(latents, velocity, sigma, sigma_next), state), record

        rows = b * (2 if cfg else 1)
        state = _CacheState.empty(rows, packed.shape[1] + (0 if references is None else references.shape[1]),
                                  model.config.dim, trace.current().activation_dtype(model.dtype), cache.taylorseer)
        (final, _), record = jax.lax.scan(cached_step, (packed, state), (jnp.arange(steps), schedule))
        return final.reshape(b, h, w, c), record
    if count != steps:  # a chunk: its slice of the schedule (the whole loop slices nothing)
        schedule = tuple(jax.lax.dynamic_slice_in_dim(s, start, count) for s in schedule)
    final, _ = jax.lax.scan(step, packed, schedule)
    return final.reshape(b, h, w, c)


@dataclass(frozen=True)
class _CacheState:
    """A step cache between steps, per transformer row: the first blocks' image-stream residual
    and the remaining blocks' residual at the row's last full step, with TaylorSeer the
    remaining residual's change per step and that step's index; consecutive cached steps."""

    first: jax.Array  # (rows, N, D) the activations' dtype (trace.activation_dtype)
    rest: jax.Array  # (rows, N, D) the activations' dtype
    slope: jax.Array | None  # (rows, N, D) float32 with TaylorSeer, else None
    last_full: jax.Array  # (rows,) int32, -1 before the first full step
    skips: jax.Array  # (rows,) int32

    @classmethod
    def empty(cls, rows: int, tokens: int, dim: int, dtype: Any, taylorseer: bool) -> _CacheState:
        zeros = jnp.zeros((rows, tokens, dim), dtype)
        return cls(zeros, zeros, jnp.zeros((rows, tokens, dim), jnp.float32) if taylorseer else None,
                   jnp.full((rows,), -1, jnp.int32), jnp.zeros((rows,), jnp.int32))


jax.tree_util.register_dataclass(
    _CacheState, data_fields=["first", "rest", "slope", "last_full", "skips"], meta_fields=[])


def _rows_where(keep: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """Per row: `a` where `keep` (rows,), else `b`."""
    return jnp.where(keep.reshape(-1, *([1] * (a.ndim - 1))), a, b)


def _cached_velocity(model: Flux2Transformer, form: CacheForm, rule: CacheRule, groups: int, tokens: jax.Array,
                     text: jax.Array, t: jax.Array, rope: Any, reference_kv: ReferenceKV | None, state: _CacheState,
                     k: jax.Array) -> tuple[jax.Array, _CacheState, CacheRecord]:
    """One step of the transformer under a step cache. The rows form `groups` equal groups (the
    CFG branches, which run as one batch); a group's remaining blocks run unless every row of it
    is cached, so a row's decision depends on its own differences alone (an image is the same
    alone or in a batch), and a cached row takes its cached residual even when its group ran."""
    rows = tokens.shape[0]
    per_group = rows // groups
    streams, inputs = model.embed(tokens, text, jnp.full((rows,), t), rope, cache=reference_kv)
    (img, txt), _, _ = model.blocks(streams, inputs, 0, form.first_blocks)
    first = img - streams[0]

    # The relative mean absolute difference against the row's last full step, in float32.
    moved = jnp.mean(jnp.abs(first.astype(jnp.float32) - state.first.astype(jnp.float32)), axis=(1, 2))
    scale = jnp.mean(jnp.abs(state.first.astype(jnp.float32)), axis=(1, 2))
    difference = jnp.where(state.last_full >= 0, moved / scale, jnp.inf)
    cached = (k >= rule.warmup) & (difference < rule.threshold) & (state.skips < rule.max_skips)

    # The remaining blocks for the groups with a row to run: none, one (its rows), or all.
    run_group = ~jnp.all(cached.reshape(groups, per_group), axis=1)

    def rest_of(streams: Streams, inputs: BlockInputs) -> jax.Array:
        return model.blocks(streams, inputs, form.first_blocks)[0][0]

    def run_none(img: jax.Array, txt: jax.Array) -> jax.Array:
        return jnp.zeros_like(img)  # every row cached: nothing of this is read

    def run_one(img: jax.Array, txt: jax.Array) -> jax.Array:
        begin = jnp.argmax(run_group) * per_group
        part = [jax.lax.dynamic_slice_in_dim(a, begin, per_group) for a in (img, txt)]
        out = rest_of((part[0], part[1]), inputs.rows(begin, per_group))
        return jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(img), out, begin, axis=0)

    def run_all(img: jax.Array, txt: jax.Array) -> jax.Array:
        return rest_of((img, txt), inputs)

    branches = [run_none, run_all] if groups == 1 else [run_none, run_one, run_all]
    index = jnp.minimum(jnp.sum(run_group), len(branches) - 1) if groups > 1 else jnp.sum(run_group)
    fresh = jax.lax.switch(index, branches, img, txt)

    # The cached rows' estimate of the remaining blocks' output: the residual at the last full
    # step (TaylorSeer: moved on along its change per step since then).
    estimate = state.rest
    if state.slope is not None:
        since = (k - state.last_full).astype(jnp.float32).reshape(-1, 1, 1)
        estimate = (state.rest.astype(jnp.float32) + state.slope * since).astype(img.dtype)
    out = _rows_where(cached, img + estimate, fresh)

    rest = fresh - img
    slope = state.slope
    if slope is not None:  # the change per step between the last two full steps (0 after the first)
        gap = jnp.maximum(k - state.last_full, 1).astype(jnp.float32).reshape(-1, 1, 1)
        step_change = (rest.astype(jnp.float32) - state.rest.astype(jnp.float32)) / gap
        slope = _rows_where(cached, slope, _rows_where(state.last_full >= 0, step_change, jnp.zeros_like(slope)))
    state = _CacheState(
        first=_rows_where(cached, state.first, first), rest=_rows_where(cached, state.rest, rest), slope=slope,
        last_full=jnp.where(cached, state.last_full, k.astype(jnp.int32)),
        skips=jnp.where(cached, state.skips + 1, 0))
    return model.head(out, inputs), state, CacheRecord(difference, cached)


@functools.cache
def noise_fn(channels: int, height: int, width: int) -> jax.stages.Wrapped:
    """seeds (B,) uint32 -> (B, height, width, channels) float32 standard normal noise: image i
    draws jax.random.normal(key(seed_i)) in diffusers' (C, h, w) layout, moved to NHWC, so a
    seed gives the same image alone or in a batch."""

    def draw(seed: jax.Array) -> jax.Array:
        return jax.random.normal(jax.random.key(seed), (channels, height, width), jnp.float32).transpose(1, 2, 0)

    return jax.jit(jax.vmap(draw))


def denoise_fn(graphdef: nnx.GraphDef, count: int | None = None, trace: TraceOptions | None = None,
               cache: CacheForm | None = None) -> jax.stages.Wrapped:
    """A jitted function of (transformer state, inputs, start step), so the same program can
    be lowered ahead of time from abstract shapes and called with real arrays. `count` steps
    per call; None: every step in one call. Traced under `trace` (None: the local forms).
    With a step cache `cache` it returns (latents, CacheRecord)."""

    def run(state: nnx.State, x: DenoiseInputs, start: jax.Array) -> Any:
        return denoise(nnx.merge(graphdef, state), x, start, count, cache)

    return jit_program(run, trace)


def steps_per_call(steps: int, calls: int) -> int:
    """Steps per call of a loop run in about `calls` calls: the largest divisor of `steps` not
    above steps / calls (at least 1), so every call runs the same program."""
    most = max(steps // max(calls, 1), 1)
    return max(k for k in range(1, most + 1) if steps % k == 0)


def reference_kv_fn(graphdef: nnx.GraphDef, trace: TraceOptions | None = None) -> jax.stages.Wrapped:
    """The references-only pass as a jitted function of (transformer state, refs (1, R, C),
    rope cos, rope sin over the reference ids) -> ReferenceKV, traced under `trace`."""

    def run(state: nnx.State, refs: jax.Array, rope_cos: jax.Array, rope_sin: jax.Array) -> ReferenceKV:
        return nnx.merge(graphdef, state).reference_kv(refs, (rope_cos, rope_sin))

    return jit_program(run, trace)


jax.tree_util.register_dataclass(
    DenoiseInputs,
    data_fields=["latents", "text", "negative_text", "references", "reference_kv", "rope_cos", "rope_sin",
                 "timesteps", "sigmas", "guidance", "init_latents", "noise", "mask", "cache_rule"],
    meta_fields=[],
)
jax.tree_util.register_dataclass(CacheRule, data_fields=["threshold", "warmup", "max_skips"], meta_fields=[])
jax.tree_util.register_dataclass(CacheRecord, data_fields=["difference", "cached"], meta_fields=[])
