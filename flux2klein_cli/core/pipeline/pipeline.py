"""Text-to-image and multi-reference editing: one pipeline, one code path.

prompt -> Qwen3 features; references -> VAE latents at their own sizes; noise -> denoise
loop (one compiled scan) -> VAE decode -> uint8 pixels. A plain edit is text-to-image with
reference tokens appended to the image tokens. A KV edit (KV-trained checkpoints) runs the
references once through a references-only pass and every denoising step in cached mode;
the engine keeps those caches per reference set and hands the pipeline the one a run needs.
The pipeline takes a `RunPlan` (core/engine/plan.py), checked once there, and checks nothing again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flux2klein_cli.core.devices.sharding import batch_spec
from flux2klein_cli.core.errors import NonFiniteError
from flux2klein_cli.core.hub.checkpoint import LoadedModels, load_models
from flux2klein_cli.core.hub.layout import Snapshot
from flux2klein_cli.core.models.layers import as_words
from flux2klein_cli.core.models.transformer import ReferenceKV
from flux2klein_cli.core.pipeline import programs, tokens
from flux2klein_cli.core.pipeline.denoise import (
    CacheRule,
    DenoiseInputs,
    build_inputs,
    denoise_fn,
    noise_fn,
    reference_kv_fn,
)
from flux2klein_cli.core.pipeline.geometry import LatentGeometry
from flux2klein_cli.core.pipeline.pixels import paste_back, postprocess
from flux2klein_cli.core.pipeline.prompt_tokenizer import PromptTokenizer
from flux2klein_cli.core.pipeline.schedule import SchedulerConfig, from_step, make_schedule, start_step
from flux2klein_cli.core.pipeline.step_cache import StepCache, cache_report
from flux2klein_cli.core.weights.configs import read_json

if TYPE_CHECKING:
    from flux2klein_cli.core.engine.plan import RunPlan
    from flux2klein_cli.core.lora.files import LoraSpec
    from flux2klein_cli.core.lora.merge import LoraDeltas


def load_tokenizer_and_scheduler(snapshot: Snapshot) -> tuple[PromptTokenizer, SchedulerConfig]:
    """The run's parts besides the three models; `inspect` loads them the same way."""
    tokenizer = PromptTokenizer(snapshot.component("tokenizer"))
    scheduler = SchedulerConfig.from_dict(read_json(snapshot.component("scheduler") / "scheduler_config.json"))
    return tokenizer, scheduler


StepCallback = Callable[[int, int], None]  # (steps done, steps in all)
Programs = Mapping[str, Any]  # program name -> its compiled executable, for one run shape


@dataclass(frozen=True)
class Chunk:
    """The loop between two of its calls (a run of `per_call` steps a call): what a caller sees
    of a run in progress. `images()` decodes the latents as they are (noisier the fewer steps
    done) with the run's own decode program, as uint8 images the run's size."""

    done: int
    steps: int
    latents: Any  # (B, h, w, C) float32 after `done` steps
    images: Callable[[], np.ndarray]


ChunkCallback = Callable[[Chunk], None]  # may raise to stop the run (a cancelled request)


@dataclass(frozen=True)
class Weights:
    """What the programs take as weights (executables take them as arguments: any weights of the
    same shapes, dtypes and shardings run with the same executables)."""

    transformer: nnx.State
    text_encoder: nnx.State


@dataclass
class Decoded:
    """A plan's images and the seconds of each phase the pipeline ran."""

    images: np.ndarray  # (B, H, W, 3) uint8
    seconds: dict[str, float]
    cache: dict[str, Any] | None = None  # with a step cache: its settings and what it skipped (cache_report)


def timed(seconds: dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    """`fn()`, waited for, its seconds added to `seconds[name]`."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
    return out


UNFIT = "does not fit this call"  # the warning's words when a stored executable is not used


def placed_on_mesh(args: Any, shardings: Any) -> Any:
    """`args` placed on a mesh as an executable takes them, `shardings` being its input shardings
    (None for an argument it does not read, which stays as it is). A host value is cut into the
    slices this process holds; an array already placed so stays. A process can move only what it
    sees whole, so a replicated array over several processes is cut here too, each process holding
    all of it; anything else goes to `jax.device_put`, which fails (a ValueError) for an array
    over several processes."""

    def place(sharding: Any, x: Any) -> Any:
        if sharding is None:
            return x
        if isinstance(x, jax.Array):
            if x.sharding.is_equivalent_to(sharding, x.ndim):  # the weights, mostly: no call per leaf
                return x
            if x.is_fully_addressable or not x.sharding.is_fully_replicated:
                return jax.device_put(x, sharding)
            x = x.addressable_data(0)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(place, shardings, args, is_leaf=lambda node: node is None)


def first_non_finite(stages: list[tuple[str, Any]], to_host: Callable[[Any], Any]) -> str | None:
    """The name of the first stage whose output holds NaN or inf (None outputs are skipped).
    Only looked at after the images went non-finite, to say where it began."""
    for name, value in stages:
        leaves = [] if value is None else jax.tree.leaves(value)
        if any(not np.isfinite(np.asarray(to_host(leaf), np.float32)).all() for leaf in leaves):
            return name
    return None


class KleinPipeline:
    """The run's programs and the weights they take: stateless between runs. What is kept
    across runs (executables per shape, reference KV caches) is the engine's
    (core/engine/caches.py)."""

    def __init__(
        self, snapshot: Snapshot, models: LoadedModels, tokenizer: PromptTokenizer, scheduler: SchedulerConfig,
        mesh: Mesh | None = None, *, warn: Callable[[str], None] | None = None, lora: LoraDeltas | None = None,
    ):
        self.snapshot, self.models, self.tokenizer, self.scheduler = snapshot, models, tokenizer, scheduler
        config = models.transformer.config
        self.geometry = LatentGeometry.of(models.vae.config, config.in_channels, config.out_channels)
        self.mesh = mesh  # None: one device, arrays where JAX puts them
        # The programs' arguments: on CPU the stacked bf16 weights as words (models/layers.py).
        self.transformer_state = as_words(nnx.state(models.transformer))
        self.text_state = as_words(nnx.state(models.text_encoder))
        self.vae_state = nnx.state(models.vae)
        self._text = programs.jit_module_call(models.text_encoder)
        self._encode = programs.jit_module_call(models.vae, programs.encode_tokens)
        self._decode = programs.jit_module_call(models.vae, programs.decode_latents)
        self._denoise_graph = nnx.split(models.transformer)[0]
        self._denoise: dict[tuple[Any, Any], Any] = {}  # (steps per call, step cache form) -> jitted loop
        self._reference_kv = reference_kv_fn(nnx.split(models.transformer)[0])
        self.warn: Callable[[str], None] = warn or (lambda message: None)
        self.lora = lora

    @classmethod
    def load(cls, model_dir: str | Path, *, dtype: Any = jnp.bfloat16, mesh: Mesh | None = None,
             lora: Sequence[LoraSpec] | LoraDeltas | None = (), warn: Callable[[str], None] | None = None
             ) -> KleinPipeline:
        """`lora`: LoRAs merged into the transformer's (and text encoder's) weights at load
        (executables take the weights as arguments, so other LoRAs or scales compile nothing new)."""
        from flux2klein_cli.core.lora.merge import LoraDeltas

        snapshot = Snapshot.open(model_dir)
        LatentGeometry.of_snapshot(snapshot.root)  # a geometry the pipeline cannot run fails before the weights load
        deltas = lora if lora is None or isinstance(lora, LoraDeltas) else LoraDeltas.read(lora)
        models = load_models(snapshot, dtype=dtype, mesh=mesh, lora=deltas)
        return cls(snapshot, models, *load_tokenizer_and_scheduler(snapshot), mesh, lora=deltas, warn=warn)

    # On a mesh every program input is a global array: batch inputs split over (data, fsdp)
    # by `_batched`, everything else replicated; GSPMD partitions the programs from there.
    def _global(self, x: Any, spec: PartitionSpec) -> jax.Array:
        assert self.mesh is not None
        if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == self.mesh:
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, NamedSharding(self.mesh, spec), lambda index: host[index])

    def _batched(self, x: Any) -> jax.Array:
        if self.mesh is None:
            return jax.device_put(x)  # unlike jnp.asarray, compiles nothing
        return self._global(x, batch_spec(self.mesh, np.shape(x)[0], np.ndim(x)))

    def _call(self, compiled_programs: Programs | None, name: str, program: Callable[..., Any], *args: Any,
              wait: bool = True) -> Any:
        """Run one program: its executable in `compiled_programs` when there is one (arguments
        placed as it was compiled for), else the jitted function. `wait=False` returns as soon as
        the call is queued (for a call after a first one that waited: the executable is known good)."""
        compiled = (compiled_programs or {}).get(name)
        if compiled is not None:
            try:
                shardings = compiled.input_shardings[0]
                placed = jax.device_put(args, shardings) if self.mesh is None else placed_on_mesh(args, shardings)
                out = compiled(*placed)
                return jax.block_until_ready(out) if wait else out
            except (TypeError, ValueError) as e:  # arguments it was not compiled for: never fail the run for it
                self.warn(f"stored executable {name} {UNFIT} ({str(e).splitlines()[0]}); "
                          "compiling it instead")
                if isinstance(compiled_programs, dict):
                    compiled_programs.pop(name, None)
        if self.mesh is None:
            return program(*args)
        args = jax.tree.map(lambda x: self._global(x, PartitionSpec()), args)
        with jax.set_mesh(self.mesh):
            return program(*args)

    def _to_host(self, x: jax.Array) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(x)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    @property
    def dtype(self) -> Any:
        return self.models.transformer.dtype

    @property
    def weights(self) -> Weights:
        return Weights(self.transformer_state, self.text_state)

    def use(self, weights: Weights) -> None:
        """Run with other weights of the same shapes from now on (a LoRA set's)."""
        self.transformer_state, self.text_state = weights.transformer, weights.text_encoder

    def load_weights(self, lora: LoraDeltas) -> Weights:
        """The weights with `lora` merged (the loader's merge, as at load): parameters it leaves
        alone are shared with the current weights, so each set holds only what it changes."""
        from flux2klein_cli.core.models.qwen3 import load_qwen3, qwen3_key_plan
        from flux2klein_cli.core.models.transformer import load_transformer, transformer_key_plan

        dtype, mesh = self.dtype, self.mesh
        transformer = load_transformer(self.snapshot.component("transformer"), dtype=dtype, mesh=mesh, deltas=lora)
        weights = Weights(_shared(transformer, transformer_key_plan(transformer), lora, self.transformer_state),
                          self.text_state)
        text_lora = lora.for_component("text_encoder")
        if text_lora is not None:
            text = load_qwen3(self.snapshot.component("text_encoder"), dtype=dtype, mesh=mesh, deltas=text_lora)
            weights = Weights(weights.transformer, _shared(text, qwen3_key_plan(text), text_lora, self.text_state))
        return weights

    def encode_text(self, prompts: Sequence[str], max_length: int, name: str = programs.TEXT_ENCODER,
                    compiled: Programs | None = None) -> jax.Array:
        ids, mask = self.tokenizer(list(prompts), max_length)
        return self._call(compiled, name, self._text, self.text_state, self._batched(ids), self._batched(mask))

    def encode_references(self, references: Sequence[np.ndarray], compiled: Programs | None = None
                          ) -> tuple[Any, list[tuple[int, int]]]:
        """Each reference through the VAE at its own size; tokens concatenated in order, (1, R, channels)."""
        if not references:
            return None, []
        packed = self.encode_images(references, compiled)
        grids = [self.geometry.grid(*image.shape[:2]) for image in references]
        if len(packed) == 1:
            return packed[0], grids
        # Joined on the host (a few MB): an eager concatenate would compile a program per run shape.
        return np.concatenate([self._to_host(p) for p in packed], axis=1), grids

    def encode_images(self, images: Sequence[np.ndarray], compiled: Programs | None = None) -> list[Any]:
        """Each image (H, W, 3) through the VAE encode program of its size: (1, tokens, channels) each."""
        return [self._call(compiled, programs.vae_encode_name(*image.shape[:2]), self._encode, self.vae_state,
                           np.asarray(image, self.dtype)[None]) for image in images]

    def reference_kv_shapes(self, references: Sequence[np.ndarray]) -> list[tuple[int, ...]]:
        """The shapes of the references' KV cache (what a stored one must have)."""
        tokens_in_all = sum(self.geometry.tokens(*image.shape[:2]) for image in references)
        return self.models.transformer.reference_kv_shapes(tokens_in_all)

    def reference_kv(self, references: Sequence[np.ndarray], seconds: dict[str, float],
                     compiled: Programs | None = None) -> ReferenceKV:
        """The references' KV cache (batch 1), computed: the VAE encode (timed under "references")
        and the references-only pass (under "reference_kv")."""
        refs, grids = timed(seconds, "references", lambda: self.encode_references(references, compiled))
        cos, sin = self.models.transformer.rope(np.zeros((0, 4), np.int32), tokens.reference_ids(grids))
        return timed(seconds, "reference_kv", lambda: self._call(
            compiled, programs.REFERENCE_KV, self._reference_kv, self.transformer_state, refs, cos, sin))

    def noise(self, plan: RunPlan, compiled: Programs | None = None) -> Any:
        """(B, h, w, channels) float32 initial noise, the denoise loop's layout: the plan's latents
        if given, else image i drawn from its own seed, so each image can be reproduced alone."""
        if plan.latents is not None:
            return np.asarray(plan.latents, np.float32).transpose(0, 2, 3, 1)
        grid = self.geometry.grid(plan.height, plan.width)
        return self._call(compiled, programs.NOISE, noise_fn(self.geometry.channels, *grid),
                          np.asarray(plan.seeds, np.uint32))

    def initial_noise(self, plan: RunPlan) -> np.ndarray:
        """The plan's noise as a host array in diffusers' (B, channels, h, w) layout, e.g. for parity."""
        noise = self.noise(plan)
        host = noise if isinstance(noise, np.ndarray) else self._to_host(noise)
        return np.ascontiguousarray(host.transpose(0, 3, 1, 2))

    def denoise(self, inputs: DenoiseInputs, steps: int, per_call: int | None = None,
                on_step: StepCallback | None = None, compiled: Programs | None = None,
                cache: StepCache | None = None, on_latents: Callable[[int, Any], None] | None = None) -> Any:
        """The loop in one call, or `per_call` steps a call with `on_step(done, steps)` after
        each (and `on_latents(done, latents)` before it). Call i + 1 is queued before call i is
        waited for, so the device never idles between calls; each call's latents are the next
        one's input, so the images are the same either way. With a step `cache` (its rule in
        `inputs`): one call, which returns (latents, CacheRecord)."""
        count = programs.denoise_count(steps, per_call)
        form = None if cache is None else cache.form
        if form is not None and count is not None:
            raise ValueError("a step-cached loop runs in one call")
        name = programs.denoise_name(count, form)
        if (count, form) not in self._denoise:
            self._denoise[(count, form)] = denoise_fn(self._denoise_graph, count, cache=form)
        program = self._denoise[(count, form)]
        if count is None:
            out = self._call(compiled, name, program, self.transformer_state, inputs, np.int32(0))
            if on_step is not None:
                on_step(steps, steps)
            return out
        latents, queued = inputs.latents, []
        for start in range(0, steps, count):
            x = dataclasses.replace(inputs, latents=latents)
            latents = self._call(compiled, name, program, self.transformer_state, x, np.int32(start),
                                 wait=start == 0)
            queued.append((start + count, latents))
            last = start + count == steps
            while len(queued) > 1 or (last and queued):  # all but the newest call, then the rest
                done, ready = queued.pop(0)
                jax.block_until_ready(ready)
                if on_latents is not None:
                    on_latents(done, ready)
                if on_step is not None:
                    on_step(done, steps)
        return latents

    def __call__(self, plan: RunPlan, *, compiled: Programs | None = None, reference_kv: ReferenceKV | None = None,
                 per_call: int | None = None, on_step: StepCallback | None = None,
                 on_chunk: ChunkCallback | None = None) -> Decoded:
        """One plan (checked once, by core/engine/plan.py) -> its uint8 images. `compiled`: the
        plan's executables (None: every program jitted); `reference_kv`: a KV edit's cache
        (the engine keeps them); `per_call`: denoising steps a call (None: the loop in one),
        with `on_chunk` hearing each call's latents as they come."""
        seconds: dict[str, float] = {}
        grid = self.geometry.grid(plan.height, plan.width)
        conditioning = ([] if plan.init_image is None else [plan.init_image]) + list(plan.references)
        strength = 1.0 if plan.strength is None else plan.strength

        # Features per prompt, repeated per image: image order is prompt-major, as in diffusers.
        # The denoise program repeats them per image and broadcasts the negative one.
        text = timed(seconds, "text", lambda: self.encode_text(plan.prompts, plan.max_sequence_length,
                                                               compiled=compiled))
        negative = None
        if plan.cfg:
            negative_name = programs.negative_text_name(len(plan.prompts))
            negative = timed(seconds, "text", lambda: self.encode_text(
                [plan.negative_prompt], plan.max_sequence_length, negative_name, compiled))
        refs, grids = None, []
        if not plan.kv:  # the init image is the first of them: its tokens are also the init latents
            refs, grids = timed(seconds, "references", lambda: self.encode_references(conditioning, compiled))
        noise = self._batched(self.noise(plan, compiled))
        schedule = make_schedule(plan.steps, grid[0] * grid[1], self.scheduler)
        if plan.init_image is not None:
            schedule = from_step(schedule, start_step(plan.steps, strength))
        inputs = build_inputs(
            self.models.transformer.rope, grid, latents=noise, text=text, negative_text=negative, references=refs,
            reference_grids=grids, reference_kv=reference_kv, schedule=schedule, guidance=plan.guidance,
            init=plan.init_image is not None, noise=None if plan.mask is None else noise, mask=plan.mask,
            cache_rule=None if plan.cache is None else CacheRule.of(plan.cache))
        on_latents = None
        if on_chunk is not None:
            def on_latents(done: int, chunk: Any) -> None:
                on_chunk(Chunk(done, plan.loop_steps, chunk, lambda: self._finish(
                    plan, np.nan_to_num(self._decoded(chunk, compiled)))))

        latents = timed(seconds, "denoise", lambda: self.denoise(inputs, plan.loop_steps, per_call, on_step,
                                                                 compiled, plan.cache, on_latents))
        cache = None
        if plan.cache is not None:
            latents, record = latents
            cache = cache_report(plan.cache, self._to_host(record.cached), self._to_host(record.difference),
                                 2 if plan.cfg else 1, self.models.transformer.depth)
        pixels = timed(seconds, "decode", lambda: self._decoded(latents, compiled))
        if not np.isfinite(pixels).all():
            stages = [("the text encoder", text), ("the text encoder (negative prompt)", negative),
                      ("the reference encoding", refs), ("the reference KV pass", reference_kv),
                      ("the denoising loop", latents)]
            raise NonFiniteError(f"{first_non_finite(stages, self._to_host) or 'the VAE decode'} produced "
                                 f"non-finite values (NaN or inf); no image was written. Check the weights "
                                 f"(flux2klein inspect MODEL) and --guidance")
        return Decoded(self._finish(plan, pixels), seconds, cache)

    def _decoded(self, latents: Any, compiled: Programs | None) -> np.ndarray:
        """(B, h, w, C) latents through the VAE decode program: (B, H, W, 3) float32 on the host."""
        images = self._call(compiled, programs.VAE_DECODE, self._decode, self.vae_state, latents)
        return self._to_host(images).astype(np.float32)

    def _finish(self, plan: RunPlan, pixels: np.ndarray) -> np.ndarray:
        out = postprocess(pixels)
        if plan.crop_box is not None:  # a padding mask crop: the crop's images back into the init image
            out = paste_back(out, plan.paste_image, plan.paste_mask, plan.crop_box)
        return out


def _shared(module: nnx.Module, plan: Any, lora: LoraDeltas, base: nnx.State) -> nnx.State:
    """`module`'s weights as the programs take them, each parameter `lora` leaves alone (none of
    its checkpoint keys changed) taken from `base` instead, so a LoRA set holds only what it changes."""
    bases = dict(nnx.to_flat_state(base))
    state = as_words(nnx.state(module))

    def pick(path: tuple[Any, ...], var: Any) -> tuple[tuple[Any, ...], Any]:
        source = plan.sources.get(path)
        if source is not None and not any(lora.changes(key) for key in source.keys):
            return path, bases[path]
        return path, var

    return nnx.from_flat_state([pick(tuple(path), var) for path, var in nnx.to_flat_state(state)])
