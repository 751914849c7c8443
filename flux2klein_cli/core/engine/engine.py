"""The long-lived engine: loaded models, executables for many shapes, KV caches; plans in, images out.

An `Engine` is built once with everything it owns (the pipeline and its models, the executable
store, the reference KV memory and disk store, the warning sink) and then runs any number of
`RunPlan`s of any shapes: each shape's executables are loaded (or compiled and stored) on its
first run and kept in a bounded LRU (`EngineOptions.executable_shapes`). Calls may come from
any thread; one lock makes the device work one at a time (a single device worker).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flux2klein_cli.core.devices.distributed import DeviceOptions
from flux2klein_cli.core.engine.plan import ModelFacts, RunFields, RunPlan, build_plan, merge_plans
from flux2klein_cli.core.errors import Flux2KleinError

Warn = Callable[[str], None]
StepCallback = Callable[[int, int], None]


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
    kv_cache_dir: Path | None = None  # reference KV caches kept here across runs
    executable_shapes: int = 8  # run shapes whose executables stay loaded
    kv_memory: int = 1  # reference KV caches kept in memory

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
                 warn: Warn, mesh: Any = None):
        self.pipeline, self.facts, self.options, self.model_dir = pipeline, facts, options, model_dir
        self.mesh, self.warn = mesh, warn
        self.stats = EngineStats()
        self._device = threading.Lock()  # one run on the device at a time

    @classmethod
    def load(cls, options: EngineOptions, model_dir: Path, *, mesh: Any = None, warn: Warn) -> Engine:
        """Load the models of `model_dir` (resolved from `options.model`) once, with the
        executable store and the KV store attached."""
        from flux2klein_cli.core.choices import jax_dtype
        from flux2klein_cli.core.compile.attach import StoredExecutables
        from flux2klein_cli.core.compile.specs import configs_from_snapshot
        from flux2klein_cli.core.compile.store import ExecutableStore
        from flux2klein_cli.core.lora.files import LoraSpec
        from flux2klein_cli.core.lora.merge import LoraDeltas
        from flux2klein_cli.core.pipeline.pipeline import KleinPipeline

        dtype = jax_dtype(options.dtype)
        lora = LoraDeltas.read([LoraSpec.parse(text) for text in options.lora])
        executables = StoredExecutables(model_dir, ExecutableStore(options.compile_cache, on_warning=warn),
                                        mesh=mesh, save=options.save_executables, effort=options.effort)
        kv_store = None
        if options.kv_cache_dir is not None:
            from flux2klein_cli.core.compile.keys import code_fingerprint
            from flux2klein_cli.core.hub.checkpoint import Snapshot
            from flux2klein_cli.core.pipeline.kv_store import ReferenceKVStore, cache_identity

            snapshot = Snapshot.open(model_dir)
            identity = cache_identity(snapshot.component("transformer"), snapshot.component("vae"),
                                      code_fingerprint())
            if lora:  # merged LoRAs change the reference K / V
                identity = f"{identity}+lora:{lora.identity()}"
            kv_store = ReferenceKVStore(options.kv_cache_dir, identity, dtype, warn)
        pipeline = KleinPipeline.load(model_dir, dtype=dtype, mesh=mesh, lora=lora, executables=executables,
                                      kv_store=kv_store, warn=warn, executable_shapes=options.executable_shapes,
                                      kv_memory=options.kv_memory)
        facts = ModelFacts.of(options.model, configs_from_snapshot(model_dir))
        return cls(pipeline, facts, options, model_dir, warn=warn, mesh=mesh)

    @property
    def lora_records(self) -> list[dict[str, Any]]:
        lora = self.pipeline.lora
        return lora.records() if lora else []

    def plan(self, fields: RunFields) -> RunPlan:
        """A request against this engine's model, checked (FieldError naming the field)."""
        return build_plan(fields, self.facts)

    def run(self, plan: RunPlan, on_step: StepCallback | None = None,
            on_phase: Callable[[str], None] | None = None) -> ImageRun:
        return self.run_batch([plan], on_step, on_phase)[0]

    def run_batch(self, plans: Sequence[RunPlan], on_step: StepCallback | None = None,
                  on_phase: Callable[[str], None] | None = None) -> list[ImageRun]:
        """Plans of one batch key (RunPlan.batch_key) as one batch; one result per plan, each
        image the same as its plan run alone would give in float32 (the noise is per image).
        `on_phase` hears `loading or compiling programs` while the shape's executables load, and
        `generating N image(s), S steps` when the run itself starts."""
        from flux2klein_cli.core.runs.images import postprocess

        merged = merge_plans(plans)
        generating = f"generating {merged.batch} image(s), {merged.steps} steps"
        executables = self.pipeline.executables
        announce: Any = contextlib.nullcontext()
        if on_phase is not None:
            if executables is not None and hasattr(executables, "announcing"):
                announce = executables.announcing(on_phase, generating)
            if executables is None or self.pipeline.shapes_kept:  # no load ahead, or maybe none: say it now
                on_phase(generating)
        with self._device, announce:
            start = time.perf_counter()
            try:
                result = self.pipeline(merged.request(), on_step=on_step)
            except Exception as e:  # a device that still runs out: one line, exit 1
                if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                    raise
                raise Flux2KleinError(f"the device ran out of memory for {merged.batch} image(s) of "
                                      f"{merged.width}x{merged.height}; try fewer images or a smaller size") from None
            images = postprocess(result.images)
            self._count(merged, result.executables)
            seconds = dict(result.seconds, total=time.perf_counter() - start)
        out, first = [], 0
        for plan in plans:
            count = plan.batch
            chunk = images[first:first + count]
            if plan.crop_box is not None:  # a padding mask crop: the crop's images back into the init image
                from flux2klein_cli.core.runs.conditioning import paste_back

                chunk = paste_back(chunk, plan.paste_image, plan.paste_mask, plan.crop_box)
            out.append(ImageRun(plan, chunk, result.seeds[first:first + count],
                                result.guidance_used, result.kv_cache, result.executables, seconds))
            first += count
        return out

    def _count(self, plan: RunPlan, report: list[dict[str, Any]]) -> None:
        stats = self.stats
        stats.runs += 1
        stats.images += plan.batch
        for info in report:
            if info.get("status") == "hit":
                stats.programs_loaded += 1
            else:
                stats.programs_compiled += 1
        stats.shapes_kept = self.pipeline.shapes_kept
        stats.executable_bytes = self.pipeline.executable_bytes

