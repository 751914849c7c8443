"""`bench --tpu PRESET` on a host without that slice: everything knowable without running.

The run's programs are compiled for the slice from the model's configs, through the
executable store, as `flux2klein compile --tpu` does (core/runs/compile.py); from them come
compile seconds per program, memory per chip and the fits verdict, and XLA's cost analysis
(flops, bytes accessed, the backend's estimated seconds) per program. The timed phases
need the slice itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

TIMED_PHASES_NOTE = "timed phases (load, compile, text, denoise, decode, per image) need the {slice} slice itself"


def bench_without_slice(model: str, *, tpu: str, height: int, width: int, batch: int, steps: int | None,
                        references: tuple[tuple[int, int], ...], kv: bool, dtype: str,
                        compile_cache: Path | None, save: bool, effort: str,
                        progress: Callable[[str], None] = lambda m: None,
                        warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    from flux2klein_cli.core.runs.compile import CompileOptions, run_compile

    refs = ",".join(f"{h}x{w}" for h, w in references) or None
    report = run_compile(CompileOptions(model=model, height=height, width=width, batch=batch, steps=steps, refs=refs,
                                        kv=kv, tpu=tpu, compile_cache=compile_cache, dtype=dtype, save=save,
                                        effort=effort), progress=progress, warn=warn)
    programs = [dict(name=p["name"], status=p["status"], compile_s=p["compile_s"], lower_s=p["lower_s"],
                     peak_bytes_per_device=p["memory"].get("peak"),
                     needed_bytes_per_device=p["needed_bytes_per_device"], cost=p.get("cost") or {})
                for p in report["programs"]]
    return dict(
        slice=report["tpu"], timed=False, note=TIMED_PHASES_NOTE.format(slice=report["tpu"]["preset"]),
        height=report["height"], width=report["width"], batch=report["batch"], steps=report["steps"],
        cfg=report["cfg"], references=report["references"], target=report["target"], store=report["store"],
        programs=programs, compile_s=sum(p["compile_s"] for p in programs if p["status"] != "hit"),
        resident_bytes_per_device=report["resident_bytes_per_device"],
        peak_bytes_per_device=report["peak_bytes_per_device"], verdict=report["verdict"],
        estimate=per_image_estimate(programs, report["batch"]),
    )


def per_image_estimate(programs: list[dict[str, Any]], batch: int) -> dict[str, Any] | None:
    """Seconds per image from XLA's cost model: each program's estimated seconds (one call
    each, the denoise loop included) summed and divided by the batch. An estimate from
    static counts, not a measurement: XLA may count a loop body (the steps, the scanned
    blocks) once, so read it as a lower bound."""
    seconds = [p["cost"].get("optimal_seconds") for p in programs]
    if not seconds or any(s is None for s in seconds):
        return None
    flops = sum(p["cost"].get("flops", 0.0) for p in programs)
    return dict(kind="estimate (XLA cost model, not measured; loop bodies may count once: a lower bound)",
                run_s=sum(seconds), per_image_s=sum(seconds) / batch, flops_per_image=flops / batch)
