"""What `flux2klein compile` does: options -> programs -> store -> report."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.errors import FieldError, Flux2KleinError, UserInputError


@dataclass
class CompileOptions:
    model: str
    height: int | None = None
    width: int | None = None
    batch: int = 1
    prompts: int = 1
    steps: int | None = None  # None: the model's default (4 distilled, 50 base)
    guidance: float | None = None  # None: the model's default; above 1 on a base model means CFG
    refs: str | None = None  # --refs: a count at the output size, or sizes "512x512,768x1024"
    kv: bool = False
    mesh: str | None = None  # "fsdp=4" or "data=2,fsdp=2" over this host's devices
    tpu: str | None = None  # a preset, e.g. v6e-4
    compile_cache: Path | None = None  # the executable store [default: cache_paths.executables_dir()]
    sequential: bool = False
    dtype: str = "bf16"
    max_sequence_length: int = DEFAULTS.max_sequence_length
    save: bool = True
    effort: str = "default"  # XLA optimisation effort, a key of target.EFFORTS
    transformer: str | None = None  # --transformer / --vae (core/hub/components.py)
    vae: str | None = None
    quantize: str | None = None  # "int8": compile for a `convert --quantize int8` model of these configs


def local_mesh_target(spec: Any) -> Any:
    """The target of `--mesh`: the mesh a run with the same `--mesh` uses (core/devices/mesh.py)."""
    from flux2klein_cli.core.compile.target import Target
    from flux2klein_cli.core.devices.mesh import make_mesh

    return Target(make_mesh(spec))


def run_compile(opts: CompileOptions, progress: Callable[[str], None] = lambda m: None,
                warn: Callable[[str], None] | None = None,
                on_done: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Resolve, build every program of the run, load or compile each, and report;
    `on_done(programs done, programs)` as each is ready."""
    from flux2klein_cli.core.choices import check_effort, jax_dtype
    from flux2klein_cli.core.compile import specs as P
    from flux2klein_cli.core.compile.compile_all import compile_all, compiles_serially
    from flux2klein_cli.core.compile.model_configs import model_configs
    from flux2klein_cli.core.compile.store import ExecutableStore
    from flux2klein_cli.core.compile.target import Target
    from flux2klein_cli.core.devices.tpu import check_topology_compiler, parse_preset
    from flux2klein_cli.core.engine.plan import ModelFacts, build_shape
    from flux2klein_cli.core.pipeline.references import parse_refs

    check_effort(opts.effort)
    if opts.mesh and opts.tpu:
        raise FieldError("mesh", "or {field:tpu}: give one, not both (a TPU preset sets its own mesh)")
    preset = parse_preset(opts.tpu) if opts.tpu else None
    from flux2klein_cli.core.devices.mesh import MeshSpec

    mesh_spec = MeshSpec.parse(opts.mesh) if opts.mesh else None  # the parser `generate` uses
    dtype = jax_dtype(opts.dtype)
    if preset is not None:
        check_topology_compiler(preset)  # no libtpu on a host without TPUs: one line, before any work
    start = time.perf_counter()
    configs = model_configs(opts.model, opts.transformer, opts.vae)
    if opts.quantize not in (None, "none"):
        from flux2klein_cli.core.choices import check_quantize

        if configs.quantize not in (None, check_quantize(opts.quantize)):
            raise UserInputError(f"{opts.model} is already quantized ({configs.quantize})")
        configs = dataclasses.replace(configs, quantize=opts.quantize)
    facts = ModelFacts.of(opts.model, configs)
    side = facts.default_side
    refs = parse_refs(opts.refs, side if opts.height is None else opts.height,
                      side if opts.width is None else opts.width)
    run = build_shape(facts, dtype=dtype, height=opts.height, width=opts.width, steps=opts.steps,
                      guidance=opts.guidance, batch=opts.batch, prompts=opts.prompts, references=refs,
                      max_sequence_length=opts.max_sequence_length, kv=opts.kv)
    if preset is not None:
        progress(f"target {preset.name} (topology {preset.topology_name})")
        target = Target.for_preset(preset)
    elif mesh_spec is not None:
        target = local_mesh_target(mesh_spec)
    else:
        target = Target.local()
    target = dataclasses.replace(target, effort=opts.effort)
    progress(f"building abstract programs for {configs.source}")
    specs = P.pipeline_programs(configs, run, target)
    store = ExecutableStore(opts.compile_cache, on_warning=warn)
    if opts.save:
        store.check_writable()  # before minutes of compiling that could not be kept
    parallel = not opts.sequential and not compiles_serially(specs)
    results = compile_all(specs, store, parallel=parallel, save=opts.save, progress=progress, on_done=on_done)
    wall = time.perf_counter() - start
    unsaved = [info.name for _, info in results if opts.save and info.status != "hit" and not info.saved]
    if unsaved:  # e.g. the disk filled up midway: the warnings said why
        raise Flux2KleinError(f"{len(unsaved)} of {len(results)} programs could not be stored in {store.root}: "
                              f"{', '.join(unsaved)}")
    report = _report(opts, configs, run, target, store, specs, [info for _, info in results], wall, parallel)
    if preset is not None:
        from flux2klein_cli.core.devices.tpu import verdict

        per_chip = max(len(target.devices) // preset.chips, 1)
        report["tpu"] = preset.describe()
        report["verdict"] = verdict(report["peak_bytes_per_device"], preset, per_chip)
    return report


def _report(opts: CompileOptions, configs: Any, run: Any, target: Any, store: Any, specs: list[Any],
            infos: list[Any], wall: float, parallel: bool) -> dict[str, Any]:
    from flux2klein_cli.core.compile.specs import resident_bytes

    resident = resident_bytes(specs)
    programs = []
    for spec, info in zip(specs, infos, strict=True):
        entry = info.as_dict()
        others = sum(v for k, v in resident.items() if k != spec.model)
        # Every model stays loaded while one program runs: its own need plus the others' weights.
        entry["needed_bytes_per_device"] = info.memory.get("peak", 0) + others if info.memory else None
        programs.append(entry)
    needs = [p["needed_bytes_per_device"] for p in programs if p["needed_bytes_per_device"] is not None]
    return {
        "model": opts.model, "source": configs.source, "height": run.height, "width": run.width,
        "batch": run.batch, "prompts": run.prompts, "steps": run.steps, "cfg": run.cfg,
        "references": [f"{w}x{h}" for h, w in run.references], "dtype": opts.dtype,
        "target": target.describe(), "store": str(store.root), "parallel": parallel,
        "programs": programs, "resident_bytes_per_device": resident,
        "peak_bytes_per_device": max(needs) if needs else 0, "wall_s": wall,
        "hits": sum(p["status"] == "hit" for p in programs),
    }
