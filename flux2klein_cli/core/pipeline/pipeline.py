"""Text-to-image and multi-reference editing: one pipeline, one code path.

prompt -> Qwen3 features; references -> VAE latents at their own sizes; noise -> denoise
loop (one compiled scan) -> VAE decode. A plain edit is text-to-image with reference tokens
appended to the image tokens. A KV edit (KV-trained checkpoints) runs the references once
through a references-only pass and every denoising step in cached mode; the cache is kept
per reference set, in memory and optionally on disk, and reused by later requests.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flux2klein_cli.core.devices.mesh import check_divides
from flux2klein_cli.core.devices.sharding import batch_spec
from flux2klein_cli.core.errors import NonFiniteError, UserInputError
from flux2klein_cli.core.hub.checkpoint import LoadedModels, Snapshot, load_models
from flux2klein_cli.core.hub.registry import DEFAULT_SIZE
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
    steps_per_call,
)
from flux2klein_cli.core.pipeline.geometry import LatentGeometry
from flux2klein_cli.core.pipeline.kv_store import ReferenceKVStore, references_digest
from flux2klein_cli.core.pipeline.prompt_tokenizer import PromptTokenizer
from flux2klein_cli.core.pipeline.schedule import SchedulerConfig, from_step, make_schedule, start_step
from flux2klein_cli.core.pipeline.step_cache import StepCache, cache_report
from flux2klein_cli.core.weights.configs import read_json

if TYPE_CHECKING:
    from flux2klein_cli.core.lora.files import LoraSpec
    from flux2klein_cli.core.lora.merge import LoraDeltas


def load_tokenizer_and_scheduler(snapshot: Snapshot) -> tuple[PromptTokenizer, SchedulerConfig]:
    """The run's parts besides the three models; `inspect` loads them the same way."""
    tokenizer = PromptTokenizer(snapshot.component("tokenizer"))
    scheduler = SchedulerConfig.from_dict(read_json(snapshot.component("scheduler") / "scheduler_config.json"))
    return tokenizer, scheduler

# With a step callback the loop runs in about this many calls (fewer when the steps have no
# divisor near steps / calls); docs/benchmarks.md has what it costs against one call.
PROGRESS_CALLS = 50

StepCallback = Callable[[int, int], None]  # (steps done, steps in all)


@dataclass
class Request:
    """One run: every prompt x num_images images, all of one size, sharing the references."""

    prompts: list[str]
    steps: int
    guidance: float
    height: int | None = None  # None: the first reference's size, else DEFAULT_SIZE
    width: int | None = None
    num_images: int = 1
    negative_prompt: str = ""
    seed: int = 0
    seeds: list[int] | None = None  # one per image (a batch of requests); None: seed + image index
    latents: np.ndarray | None = None  # LatentGeometry.latents_shape initial noise, diffusers' convention
    references: list[np.ndarray] = field(default_factory=list)  # preprocessed (H, W, 3) in [-1, 1]
    max_sequence_length: int = 512
    kv: bool = False  # reference KV cache (KV-trained checkpoints only)
    # Image-to-image / inpainting: the init image preprocessed as a reference, (H, W, 3) in [-1, 1]
    # at the output size; it is also the first conditioning image, before `references`.
    init_image: np.ndarray | None = None
    mask: np.ndarray | None = None  # inpainting: (h, w) float32 on the token grid, 1 repaint .. 0 keep
    strength: float = 1.0  # with an init image: how much of the schedule runs (schedule.start_step)
    cache: StepCache | None = None  # step caching (base models); None: every block every step

    @property
    def batch(self) -> int:
        return len(self.prompts) * self.num_images

    @property
    def conditioning(self) -> list[np.ndarray]:
        """The images the transformer attends to, in order: the init image, then the references."""
        return ([] if self.init_image is None else [self.init_image]) + list(self.references)

    def loop_steps(self) -> int:
        """Steps the denoise loop runs: all of them, or from the init image's start step on."""
        if self.init_image is None:
            return self.steps
        from flux2klein_cli.core.pipeline.schedule import start_step

        return self.steps - start_step(self.steps, self.strength)


@dataclass
class Result:
    images: np.ndarray  # (B, H, W, 3) float32, about [-1, 1]
    seeds: list[int]  # the seed of each image's noise (None-free even with --latents: the base seed)
    height: int
    width: int
    guidance_used: bool
    seconds: dict[str, float]
    kv_cache: str | None = None  # with a KV edit: where the cache came from (computed, memory, disk)
    executables: list[dict[str, Any]] = field(default_factory=list)  # what the store did per program (LoadInfo)
    cache: dict[str, Any] | None = None  # with a step cache: its settings and what it skipped (cache_report)


def _timed(seconds: dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
    return out


def check_seeds(first: int, count: int) -> None:
    """Image i draws from seed first + i into a 32-bit noise key: a larger seed would repeat a
    smaller one's noise."""
    last = first + count - 1
    if last >= 2**32:
        raise UserInputError(f"--seed + image index must stay below 2**32 (4294967296), got {last}")


def _code_bytes(info: dict[str, Any]) -> int:
    """An executable's code as XLA reports it, else (the CPU reports none) its serialized size."""
    code = int(info.get("memory", {}).get("generated_code", 0))
    path = info.get("path")
    if not code and path and (Path(path) / "executable.bin").is_file():
        code = (Path(path) / "executable.bin").stat().st_size
    return code


def first_non_finite(stages: list[tuple[str, Any]], to_host: Callable[[Any], Any]) -> str | None:
    """The name of the first stage whose output holds NaN or inf (None outputs are skipped).
    Only looked at after the images went non-finite, to say where it began."""
    for name, value in stages:
        leaves = [] if value is None else jax.tree.leaves(value)
        if any(not np.isfinite(np.asarray(to_host(leaf), np.float32)).all() for leaf in leaves):
            return name
    return None


# Executables kept per run shape (an LRU): a long-lived engine alternating shapes loads each once.
EXECUTABLE_SHAPES = 8
Programs = Mapping[str, Any]  # program name -> its compiled executable, for one run shape


class KleinPipeline:
    def __init__(
        self, snapshot: Snapshot, models: LoadedModels, tokenizer: PromptTokenizer, scheduler: SchedulerConfig,
        mesh: Mesh | None = None, *, executables: Any = None, kv_store: ReferenceKVStore | None = None,
        warn: Callable[[str], None] | None = None, lora: LoraDeltas | None = None,
        progress_calls: int = PROGRESS_CALLS, executable_shapes: int = EXECUTABLE_SHAPES, kv_memory: int = 1,
    ):
        """`executables`: a store of executables (core/compile/attach.py): each run shape's
        programs are loaded or compiled up front and called directly; None: each program is
        jitted. `kv_memory`: reference KV caches kept in memory (a 9B cache is about 2 GiB per
        1024x1024 reference)."""
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
        self.kv_store = kv_store
        self.kv_memory = kv_memory
        self._kv_memory: OrderedDict[str, ReferenceKV] = OrderedDict()
        self.executables = executables
        self.executable_shapes = executable_shapes
        # run shape -> (its executables, their generated code bytes as XLA reports them)
        self._by_shape: OrderedDict[programs.RunShape, tuple[dict[str, Any], int]] = OrderedDict()
        self.warn: Callable[[str], None] = warn or (lambda message: None)
        self.progress_calls = progress_calls
        self.lora = lora

    @classmethod
    def load(cls, model_dir: str | Path, *, dtype: Any = jnp.bfloat16, mesh: Mesh | None = None,
             lora: Sequence[LoraSpec] | LoraDeltas | None = (), **parts: Any) -> KleinPipeline:
        """`lora`: LoRAs merged into the transformer's (and text encoder's) weights at load
        (executables take the weights as arguments, so other LoRAs or scales compile nothing new);
        `parts`: the constructor's keyword arguments."""
        from flux2klein_cli.core.lora.merge import LoraDeltas

        snapshot = Snapshot.open(model_dir)
        LatentGeometry.of_snapshot(snapshot.root)  # a geometry the pipeline cannot run fails before the weights load
        deltas = lora if lora is None or isinstance(lora, LoraDeltas) else LoraDeltas.read(lora)
        models = load_models(snapshot, dtype=dtype, mesh=mesh, lora=deltas)
        return cls(snapshot, models, *load_tokenizer_and_scheduler(snapshot), mesh, lora=deltas, **parts)

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
        if self.mesh is not None:
            args = jax.tree.map(lambda x: self._global(x, PartitionSpec()), args)
        compiled = (compiled_programs or {}).get(name)
        if compiled is not None:
            try:
                out = compiled(*jax.device_put(args, compiled.input_shardings[0]))
                return jax.block_until_ready(out) if wait else out
            except (TypeError, ValueError) as e:  # arguments it was not compiled for: never fail the run for it
                self.warn(f"stored executable {name} does not fit this call ({str(e).splitlines()[0]}); "
                          "compiling it instead")
                if isinstance(compiled_programs, dict):
                    compiled_programs.pop(name, None)
        if self.mesh is None:
            return program(*args)
        with jax.set_mesh(self.mesh):
            return program(*args)

    def run_shape(self, request: Request, per_call: int | None = None) -> programs.RunShape:
        height, width = self.output_size(request)
        return programs.RunShape(
            height=height, width=width, geometry=self.geometry, batch=request.batch, prompts=len(request.prompts),
            steps=request.loop_steps(), references=tuple(tuple(r.shape[:2]) for r in request.conditioning),
            cfg=self.uses_guidance(request.guidance), max_sequence_length=request.max_sequence_length,
            dtype=self.dtype, kv=request.kv and bool(request.references), steps_per_call=per_call,
            init=request.init_image is not None, mask=request.mask is not None,
            cache=None if request.cache is None else request.cache.form)

    def prepare(self, request: Request, per_call: int | None = None) -> tuple[Programs, list[dict[str, Any]]]:
        """The executables `request` needs, loaded (or compiled and stored) once per run shape
        and kept for the last `executable_shapes` shapes; with what the store did per program
        (empty when they were kept from an earlier call). Without a store, none: programs are
        jitted on first use."""
        if self.executables is None:
            return {}, []
        run = self.run_shape(request, per_call)
        kept = self._by_shape.get(run)
        if kept is not None:
            self._by_shape.move_to_end(run)
            return kept[0], []
        try:
            compiled = self.executables.for_run(run)
            report = self.executables.report
        except Exception as e:  # the store is an optimisation: never the reason a run fails
            self.warn(f"stored executables unavailable ({type(e).__name__}: {str(e).splitlines()[0]}); "
                      "compiling as needed")
            compiled, report = {}, []
        code = sum(_code_bytes(info) for info in report)
        self._by_shape[run] = (compiled, code)
        while len(self._by_shape) > self.executable_shapes:
            self._by_shape.popitem(last=False)
        return compiled, report

    @property
    def shapes_kept(self) -> int:
        return len(self._by_shape)

    @property
    def executable_bytes(self) -> int:
        """Generated code of the kept shapes' executables (what the LRU holds, as XLA reports it)."""
        return sum(code for _, code in self._by_shape.values())

    def _to_host(self, x: jax.Array) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(x)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    @property
    def dtype(self) -> Any:
        return self.models.transformer.dtype

    def uses_guidance(self, guidance: float) -> bool:
        """Real classifier-free guidance only for undistilled (base) models, as the reference does."""
        return not self.snapshot.is_distilled and guidance > 1.0

    def encode_text(self, prompts: list[str], max_length: int = 512, name: str = programs.TEXT_ENCODER,
                    compiled: Programs | None = None) -> jax.Array:
        ids, mask = self.tokenizer(prompts, max_length)
        return self._call(compiled, name, self._text, self.text_state, self._batched(ids), self._batched(mask))

    def encode_references(self, references: list[np.ndarray], compiled: Programs | None = None
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

    def encode_images(self, images: list[np.ndarray], compiled: Programs | None = None) -> list[Any]:
        """Each image (H, W, 3) through the VAE encode program of its size: (1, tokens, channels) each."""
        return [self._call(compiled, programs.vae_encode_name(*image.shape[:2]), self._encode, self.vae_state,
                           np.asarray(image, self.dtype)[None]) for image in images]

    def reference_kv(
        self, references: list[np.ndarray], seconds: dict[str, float] | None = None,
        compiled: Programs | None = None,
    ) -> tuple[ReferenceKV, str]:
        """The references' KV cache (batch 1) and where it came from: memory, disk or computed.
        `seconds` gets the VAE encode under "references" and the references-only pass under
        "reference_kv"."""
        seconds = {} if seconds is None else seconds
        digest = references_digest(references)
        if digest in self._kv_memory:
            self._kv_memory.move_to_end(digest)
            return self._kv_memory[digest], "memory"
        reference_tokens = sum(int(np.prod(self.geometry.grid(*image.shape[:2]))) for image in references)
        shapes = self.models.transformer.reference_kv_shapes(reference_tokens)
        kv, source = (self.kv_store.load(digest, shapes) if self.kv_store else None), "disk"
        if kv is None:
            refs, grids = _timed(seconds, "references", lambda: self.encode_references(references, compiled))
            cos, sin = self.models.transformer.rope(np.zeros((0, 4), np.int32), tokens.reference_ids(grids))
            kv = _timed(seconds, "reference_kv", lambda: self._call(
                compiled, programs.REFERENCE_KV, self._reference_kv, self.transformer_state, refs, cos, sin))
            source = "computed"
            if self.kv_store:
                self.kv_store.save(digest, kv)
        self._kv_memory[digest] = kv
        while len(self._kv_memory) > self.kv_memory:
            self._kv_memory.popitem(last=False)
        return kv, source

    def forget_reference_kv(self) -> None:
        """Drop the in-memory reference KV caches (a benchmark's every timed edit computes its own)."""
        self._kv_memory.clear()

    def noise_latents(self, request: Request, grid: tuple[int, int], compiled: Programs | None = None
                      ) -> tuple[Any, list[int]]:
        """(B, h, w, channels) float32 initial noise, the denoise loop's layout (`latents` if given);
        image i draws from its own seed (seed + i unless `seeds` are given), so each image can be
        reproduced alone."""
        shape = (request.batch, self.geometry.channels, *grid)
        seeds = list(request.seeds) if request.seeds is not None else [request.seed + i for i in range(request.batch)]
        if len(seeds) != request.batch:
            raise ValueError(f"{len(seeds)} seeds for {request.batch} images")
        if request.latents is not None:
            if tuple(request.latents.shape) != shape:
                raise UserInputError(f"--latents has shape {tuple(request.latents.shape)}, expected {shape}")
            return np.asarray(request.latents, np.float32).transpose(0, 2, 3, 1), seeds
        if min(seeds) < 0 or max(seeds) >= 2**32:
            raise UserInputError(f"seeds must lie in 0 .. 2**32 - 1, got {min(seeds)} .. {max(seeds)}")
        noise = self._call(compiled, programs.NOISE, noise_fn(self.geometry.channels, *grid),
                           np.asarray(seeds, np.uint32))
        return noise, seeds

    def initial_noise(self, request: Request, grid: tuple[int, int]) -> tuple[np.ndarray, list[int]]:
        """The same noise as a host array in diffusers' (B, channels, h, w) layout, e.g. for parity."""
        noise, seeds = self.noise_latents(request, grid)
        return np.ascontiguousarray(self._to_host(noise).transpose(0, 3, 1, 2)), seeds

    def output_size(self, request: Request) -> tuple[int, int]:
        conditioning = request.conditioning
        first = conditioning[0].shape[:2] if conditioning else (DEFAULT_SIZE, DEFAULT_SIZE)
        return request.height or first[0], request.width or first[1]

    def denoise(self, inputs: DenoiseInputs, steps: int, per_call: int | None = None,
                on_step: StepCallback | None = None, compiled: Programs | None = None,
                cache: StepCache | None = None) -> Any:
        """The loop in one call, or `per_call` steps a call with `on_step(done, steps)` after
        each. Call i + 1 is queued before call i is waited for, so the device never idles
        between calls; each call's latents are the next one's input, so the images are the
        same either way. With a step `cache` (its rule in `inputs`): one call, which returns
        (latents, CacheRecord)."""
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
                if on_step is not None:
                    on_step(done, steps)
        return latents

    def __call__(self, request: Request, on_step: StepCallback | None = None) -> Result:
        """One request (checked by its plan: core/engine/plan.py) -> decoded images."""
        if not request.prompts or request.steps < 1 or (request.kv and not request.references):
            raise ValueError("a request needs prompts, steps and, for a KV edit, references (build it from a plan)")
        if request.init_image is not None and (request.kv or not 0.0 < request.strength <= 1.0):
            raise ValueError("an init image takes a strength in (0, 1] and no KV edit (build it from a plan)")
        if request.mask is not None and request.init_image is None:
            raise ValueError("a mask needs an init image (build the request from a plan)")
        seconds: dict[str, float] = {}
        steps = request.loop_steps()
        # A step-cached loop keeps its cache inside the one call: its progress comes at the end.
        per_call = None if on_step is None or request.cache else steps_per_call(steps, self.progress_calls)
        compiled, report = {}, []
        if self.executables is not None:
            compiled, report = _timed(seconds, "executables", lambda: self.prepare(request, per_call))
        if self.mesh is not None:
            check_divides(self.mesh, batch=request.batch, heads=self.models.transformer.config.num_attention_heads)
        height, width = self.output_size(request)
        grid = self.geometry.grid(height, width)
        cfg = self.uses_guidance(request.guidance)

        # Features per prompt, repeated per image: image order is prompt-major, as in diffusers.
        # The denoise program repeats them per image and broadcasts the negative one.
        text = _timed(seconds, "text", lambda: self.encode_text(request.prompts, request.max_sequence_length,
                                                                compiled=compiled))
        negative = None
        if cfg:
            negative_name = programs.negative_text_name(len(request.prompts))
            negative = _timed(seconds, "text", lambda: self.encode_text(
                [request.negative_prompt], request.max_sequence_length, negative_name, compiled))
        refs, kv, kv_source, grids = None, None, None, []
        if request.kv:
            kv, kv_source = self.reference_kv(request.references, seconds, compiled)
        else:  # the init image is the first of them: its tokens are also the init latents
            refs, grids = _timed(seconds, "references", lambda: self.encode_references(request.conditioning, compiled))
        noise, seeds = self.noise_latents(request, grid, compiled)
        schedule = make_schedule(request.steps, grid[0] * grid[1], self.scheduler)
        if request.init_image is not None:
            schedule = from_step(schedule, start_step(request.steps, request.strength))
        noise = self._batched(noise)
        inputs = build_inputs(
            self.models.transformer.rope, grid, latents=noise, text=text, negative_text=negative, references=refs,
            reference_grids=grids, reference_kv=kv, schedule=schedule, guidance=request.guidance,
            init=request.init_image is not None, noise=None if request.mask is None else noise, mask=request.mask,
            cache_rule=None if request.cache is None else CacheRule.of(request.cache))
        latents = _timed(seconds, "denoise",
                         lambda: self.denoise(inputs, steps, per_call, on_step, compiled, request.cache))
        cache = None
        if request.cache is not None:
            latents, record = latents
            cache = cache_report(request.cache, self._to_host(record.cached), 2 if cfg else 1,
                                 self.models.transformer.depth)
        images = _timed(seconds, "decode",
                        lambda: self._call(compiled, programs.VAE_DECODE, self._decode, self.vae_state, latents))
        pixels = self._to_host(images).astype(np.float32)
        if not np.isfinite(pixels).all():
            stages = [("the text encoder", text), ("the text encoder (negative prompt)", negative),
                      ("the reference encoding", refs), ("the reference KV pass", kv),
                      ("the denoising loop", latents)]
            raise NonFiniteError(f"{first_non_finite(stages, self._to_host) or 'the VAE decode'} produced "
                                 f"non-finite values (NaN or inf); no image was written. Check the weights "
                                 f"(flux2klein inspect MODEL) and --guidance")
        return Result(pixels, seeds, height, width, cfg, seconds, kv_source, report, cache)
