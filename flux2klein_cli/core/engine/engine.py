"""The long-lived engine: loaded models, executables for many shapes, KV caches; plans in, images out.

An `Engine` is built once with everything it owns (the pipeline and its models, the executable
store, the reference KV memory and disk store, the warning sink) and then runs any number of
`RunPlan`s of any shapes: each shape's executables are loaded (or compiled and stored) on its
first run and kept in a bounded LRU (`EngineOptions.executable_shapes`, core/engine/caches.py).
Calls may come from any thread; one lock makes the device work one at a time (a single device
worker), and guards the caches with it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.devices.distributed import DeviceOptions
from flux2klein_cli.core.engine.plan import ModelFacts, RunFields, RunPlan, build_plan, merge_plans
from flux2klein_cli.core.errors import FieldError, Flux2KleinError

Warn = Callable[[str], None]
StepCallback = Callable[[int, int], None]
ChunkCallback = Callable[[Any], None]  # hears core/pipeline/pipeline.Chunk


@dataclass(frozen=True)
class EngineOptions:
    """What an engine is built with: the model and how it runs, not what it is asked for."""

    model: str
    dtype: str = "bf16"
    devices: DeviceOptions = field(default_factory=DeviceOptions)
    compile_cache: Path | None = None  # the executable store [default: FLUX2KLEIN_COMPILE_CACHE or the user cache]
    save_executables: bool = True  # False: use stored executables, store nothing new
    effort: str = "default"  # XLA optimisation effort of compiled executables (compile.target.EFFORTS)
    transformer: str | None = None  # the transformer from elsewhere (core/hub/components.py)
    vae: str | None = None
    lora: tuple[str, ...] = ()  # PATH_OR_REPO[:SCALE], merged at load
    # Named LoRA sets a plan may pick (RunPlan.lora_set): (name, its PATH_OR_REPO[:SCALE]s), each
    # merged on top of `lora` into weights of its own at load; every set runs the same executables.
    lora_sets: tuple[tuple[str, tuple[str, ...]], ...] = ()
    kv_cache_dir: Path | None = None  # reference KV caches kept here across runs
    executable_shapes: int = DEFAULTS.executable_shapes  # run shapes whose executables stay loaded
    kv_memory: int = DEFAULTS.kv_memory  # reference KV caches kept in memory
    store: bool = True  # False: no executable store at all, every program jitted on first use (bench --no-store)

    @property
    def components(self) -> dict[str, str]:
        """The overridden components' sources, as given, for PNG metadata and reports."""
        return {name: value for name, value in (("transformer", self.transformer), ("vae", self.vae)) if value}


@dataclass
class ImageRun:
    """One plan's result: uint8 images and what the run did."""

    plan: RunPlan
    images: np.ndarray  # (B, H, W, 3) uint8
    seeds: list[int]
    cfg: bool
    kv_cache: str | None  # with a KV edit: where the cache came from (computed, memory, disk)
    executables: list[dict[str, Any]]  # what the store did per program (empty: kept from an earlier run)
    seconds: dict[str, float]
    cache: dict[str, Any] | None = None  # with a step cache: its settings and what it skipped


@dataclass
class EngineStats:
    """Counters over the engine's life (`batch` and `serve` report them)."""

    runs: int = 0
    images: int = 0
    programs_compiled: int = 0
    programs_loaded: int = 0
    shapes_kept: int = 0
    executable_bytes: int = 0  # generated code of the kept shapes' executables, as XLA reports it

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Engine:
    def __init__(self, pipeline: Any, facts: ModelFacts, options: EngineOptions, model_dir: Path, *,
                 warn: Warn, mesh: Any = None, executables: Any = None, kv_store: Any = None):
        """`executables`: the executable store (compile/attach.StoredExecutables; None: every
        program jitted), or an ExecutableCache already on it (`load`'s, with programs loading
        ahead); `kv_store`: the reference KV caches on disk (None: memory only)."""
        from flux2klein_cli.core.engine.caches import ExecutableCache, ReferenceKVCache

        self.pipeline, self.facts, self.options, self.model_dir = pipeline, facts, options, model_dir
        self.mesh, self.warn = mesh, warn
        self.executables = executables if isinstance(executables, ExecutableCache) else ExecutableCache(
            executables, options.executable_shapes, warn)
        self.reference_kv = ReferenceKVCache(pipeline, kv_store, options.kv_memory)
        self.stats = EngineStats()
        self._device = threading.Lock()  # one run on the device at a time
        self.weight_sets: dict[str | None, Any] = {None: pipeline.weights}  # LoRA set -> its weights
        self.lora_set_records: dict[str, list[dict[str, Any]]] = {}
        self._lora_set_ids: dict[str | None, str] = {None: ""}  # what a set's weights are (content hashes)

    def add_lora_set(self, name: str, specs: Sequence[str]) -> None:
        """Load LoRA set `name` (its LoRAs on top of the engine's own) into weights of its own."""
        from flux2klein_cli.core.lora.files import LoraSpec
        from flux2klein_cli.core.lora.merge import LoraDeltas

        lora = LoraDeltas.read([LoraSpec.parse(text) for text in (*self.options.lora, *specs)])
        assert lora is not None
        with self._device:
            self.weight_sets[name] = self.pipeline.load_weights(lora)
            self.lora_set_records[name] = lora.records()
            self._lora_set_ids[name] = lora.identity()

    @classmethod
    def load(cls, options: EngineOptions, model_dir: Path, *, mesh: Any = None, warn: Warn,
             ahead: Sequence[RunPlan] = (), progress: bool = False) -> Engine:
        """Load the models of `model_dir` (resolved from `options.model`) once, with the
        executable store and the KV store attached. `ahead`: the plans of the first run (as one
        batch, with `progress` as `run_batch` has it), whose executables load from the store
        while the weights do."""
        from flux2klein_cli.core.choices import jax_dtype
        from flux2klein_cli.core.compile.model_configs import configs_from_snapshot
        from flux2klein_cli.core.engine.caches import ExecutableCache
        from flux2klein_cli.core.lora.files import LoraSpec
        from flux2klein_cli.core.lora.merge import LoraDeltas
        from flux2klein_cli.core.pipeline.pipeline import KleinPipeline

        dtype = jax_dtype(options.dtype)
        lora = LoraDeltas.read([LoraSpec.parse(text) for text in options.lora])
        # A load that fails leaves the programs' thread (`ahead`) running to its end; what it says
        # then belongs to no run, and an in-process caller would see it under whatever comes next.
        failed = threading.Event()

        def gated_warn(message: str) -> None:  # `warn`, silent once the load has failed
            if not failed.is_set():
                warn(message)

        try:
            executables = None
            if options.store:
                from flux2klein_cli.core.compile.attach import StoredExecutables
                from flux2klein_cli.core.compile.store import ExecutableStore

                store = ExecutableStore(options.compile_cache, on_warning=gated_warn)
                executables = StoredExecutables(model_dir, store, mesh=mesh, save=options.save_executables,
                                                effort=options.effort)
            cache = ExecutableCache(executables, options.executable_shapes, gated_warn)
            if ahead:  # the first run's programs load while the weights do
                merged, per_call = batch_run(ahead, None, progress)
                cache.prefetch(merged.shape(dtype, per_call))
            kv_store = None
            if options.kv_cache_dir is not None:
                from flux2klein_cli.core.compile.keys import code_fingerprint
                from flux2klein_cli.core.hub.layout import Snapshot
                from flux2klein_cli.core.pipeline.kv_store import ReferenceKVStore, cache_identity

                snapshot = Snapshot.open(model_dir)
                identity = cache_identity(snapshot.component("transformer"), snapshot.component("vae"),
                                          code_fingerprint())
                if lora:  # merged LoRAs change the reference K / V
                    identity = f"{identity}+lora:{lora.identity()}"
                kv_store = ReferenceKVStore(options.kv_cache_dir, identity, dtype, gated_warn)
            pipeline = KleinPipeline.load(model_dir, dtype=dtype, mesh=mesh, lora=lora, warn=gated_warn)
            facts = ModelFacts.of(options.model, configs_from_snapshot(model_dir))
            engine = cls(pipeline, facts, options, model_dir, warn=gated_warn, mesh=mesh, executables=cache,
                         kv_store=kv_store)
            for name, specs in options.lora_sets:
                engine.add_lora_set(name, specs)
            return engine
        except BaseException:
            failed.set()
            raise

    @property
    def lora_records(self) -> list[dict[str, Any]]:
        lora = self.pipeline.lora
        return lora.records() if lora else []

    def plan(self, fields: RunFields) -> RunPlan:
        """A request against this engine's model, checked (FieldError naming the field)."""
        if fields.lora_set not in self.weight_sets:
            sets = ", ".join(name for name in self.weight_sets if name) or "none"
            raise FieldError("lora_set", f"is {fields.lora_set!r}, which this engine does not have (its LoRA sets: "
                             f"{sets})")
        return build_plan(fields, self.facts)

    def run(self, plan: RunPlan, on_step: StepCallback | None = None,
            on_phase: Callable[[str], None] | None = None, *, steps_per_call: int | None = None) -> ImageRun:
        return self.run_batch([plan], on_step, on_phase, steps_per_call=steps_per_call)[0]

    def run_batch(self, plans: Sequence[RunPlan], on_step: StepCallback | None = None,
                  on_phase: Callable[[str], None] | None = None, *,
                  steps_per_call: int | None = None, on_chunk: ChunkCallback | None = None) -> list[ImageRun]:
        """Plans of one batch key (RunPlan.batch_key) as one batch; one result per plan, each
        image the same as its plan run alone would give in float32 (the noise is per image).
        `on_phase` hears `loading or compiling programs` while the shape's executables load, and
        `generating N image(s), S steps` when the run itself starts. The loop runs in one call,
        or `steps_per_call` steps a call (a divisor of the loop's steps); with `on_step` and no
        `steps_per_call`, in about DEFAULTS.progress_calls calls (fewer when the steps have no
        divisor near steps / calls; docs/benchmarks.md has what it costs), `on_step(done, steps)`
        after each, and `on_chunk(chunk)` with the batch's latents so far (pipeline.Chunk: they
        decode on request; raising from a callback stops the run).
        Each result's `seconds` has every phase the run went through (`executables`, `text`,
        `references`, `reference_kv`, `denoise`, `decode`) and `total`."""
        from flux2klein_cli.core.pipeline.pipeline import timed

        merged, per_call = batch_run(plans, steps_per_call, on_step is not None)
        shape = merged.shape(self.pipeline.dtype, per_call)
        generating = f"generating {merged.batch} image(s), {merged.steps} steps"
        store = self.executables.store
        announce: Any = contextlib.nullcontext()
        if on_phase is not None and self.executables.ahead(shape):  # loaded, or loading, while the weights did
            if self.executables.pending(shape):
                from flux2klein_cli.core.compile.attach import LOADING_PHASE

                on_phase(LOADING_PHASE)
            announce = _then(on_phase, generating)
        elif on_phase is not None:
            if store is not None and hasattr(store, "announcing"):
                announce = store.announcing(on_phase, generating)
            if store is None or self.executables.shapes_kept:  # no load ahead, or maybe none: say it now
                on_phase(generating)
        with self._device, announce:
            start = time.perf_counter()
            seconds: dict[str, float] = {}
            if self.mesh is not None:
                from flux2klein_cli.core.devices.mesh import check_divides

                check_divides(self.mesh, batch=merged.batch,
                              heads=self.pipeline.models.transformer.config.num_attention_heads)
            compiled, report = (timed(seconds, "executables", lambda: self.executables.get(shape))
                                if store is not None else ({}, []))
            self.pipeline.use(self.weight_sets[merged.lora_set])  # a pointer swap: nothing compiles
            try:
                kv, kv_source = None, None
                if merged.kv:  # a set's weights give the references other K / V
                    kv, kv_source = self.reference_kv.get(merged.references, seconds, compiled,
                                                          salt=self._lora_set_ids[merged.lora_set])
                result = self.pipeline(merged, compiled=compiled, reference_kv=kv, per_call=per_call,
                                       on_step=on_step, on_chunk=on_chunk)
            except Exception as e:  # a device that still runs out: one line, exit 1
                if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                    raise
                raise Flux2KleinError(f"the device ran out of memory for {merged.batch} image(s) of "
                                      f"{merged.width}x{merged.height}; try fewer images or a smaller size") from None
            self._count(merged, report)
            seconds = dict(seconds, **result.seconds, total=time.perf_counter() - start)
        out, first = [], 0
        for plan in plans:
            count = plan.batch
            out.append(ImageRun(plan, result.images[first:first + count], list(merged.seeds[first:first + count]),
                                merged.cfg, kv_source, report, seconds, result.cache))
            first += count
        return out

    def initial_noise(self, plan: RunPlan) -> np.ndarray:
        """The noise `plan` starts from, in diffusers' (B, channels, h, w) layout (parity hands
        it to diffusers): its latents, or each image's draw from its seed."""
        with self._device:
            return self.pipeline.initial_noise(plan)

    def forget_reference_kv(self) -> None:
        """Drop the reference KV caches held in memory (a benchmark's timed edits compute their own)."""
        with self._device:
            self.reference_kv.forget()

    def _count(self, plan: RunPlan, report: list[dict[str, Any]]) -> None:
        stats = self.stats
        stats.runs += 1
        stats.images += plan.batch
        for info in report:
            if info.get("status") == "hit":
                stats.programs_loaded += 1
            else:
                stats.programs_compiled += 1
        stats.shapes_kept = self.executables.shapes_kept
        stats.executable_bytes = self.executables.executable_bytes



def batch_run(plans: Sequence[RunPlan], steps_per_call: int | None, progress: bool) -> tuple[RunPlan, int | None]:
    """`plans` as the one batch `Engine.run_batch` runs, and its steps per call: `steps_per_call`,
    or with `progress` (an `on_step` callback) about DEFAULTS.progress_calls calls, or one call
    for a step-cached loop (its cache stays inside one call)."""
    from flux2klein_cli.core.pipeline.denoise import steps_per_call as progress_steps

    merged = merge_plans(plans)
    if merged.cache is not None:
        return merged, None
    if steps_per_call is None and progress:
        return merged, progress_steps(merged.loop_steps, DEFAULTS.progress_calls)
    return merged, steps_per_call


@contextlib.contextmanager
def _then(on_phase: Callable[[str], None], phase: str) -> Iterator[None]:
    """Says `phase` when the block's first part (a wait for programs loading ahead) is done:
    on leaving it, as a store's `announcing` does."""
    try:
        yield
    finally:
        on_phase(phase)
