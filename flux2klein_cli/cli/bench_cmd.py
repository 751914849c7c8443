"""`flux2klein bench`: timings, as a table on stdout or one JSON object."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Annotated, Any

import typer

from flux2klein_cli.cli import options as o
from flux2klein_cli.cli import output
from flux2klein_cli.cli.flags import SHAPE_FLAGS
from flux2klein_cli.cli.output import Table, emit_json, note, show_table, status, user_errors, warn
from flux2klein_cli.core import choices
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.hub.registry import DEFAULT_MODEL


def bench(
    model: Annotated[str, typer.Option("--model", "-m", help=o.model_help(" (geometry only for "
                                                                          "transformer-compile)"))] = DEFAULT_MODEL,
    phase: Annotated[o.Phase, o.choice_option(o.Phase, choices.check_phase, "--phase", help="What to time.")
                     ] = o.Phase.pipeline,
    height: Annotated[int, typer.Option("--height", help="Image height in pixels (a multiple of the model's "
                                        "pixels per token: 16 for klein).")] = DEFAULTS.side,
    width: Annotated[int, typer.Option("--width", help="Image width in pixels (as --height).")] = DEFAULTS.side,
    bs: Annotated[int, typer.Option("--bs", help="Batch size (images per run).")] = 1,
    steps: o.StepsOpt = None,
    reps: Annotated[int, typer.Option("--reps", help="Timed repetitions after the first call; min and median.")] = 3,
    dtype: o.DtypeOpt = o.Dtype.bf16,
    refs: o.RefsOpt = None,
    kv: Annotated[bool, typer.Option("--kv", help="pipeline, with --refs on a KV model: time the edit plain and "
                                     "with the reference KV cache; report the speed-up beside its token-count "
                                     "bound.")] = False,
    mesh: Annotated[str | None, typer.Option("--mesh", help="pipeline: device mesh axis sizes, e.g. fsdp=4 (see "
                                             "generate).")] = None,
    tpu: Annotated[str | None, typer.Option("--tpu", help="pipeline, e.g. v6-4: on that slice, the preset's mesh "
                                            "(FSDP over its chips); on any other host, the run compiled for it: "
                                            "compile seconds, memory per chip, fits verdict and XLA cost per program "
                                            "(timed phases need the slice).")] = None,
    unrolled: Annotated[bool, typer.Option("--unrolled", help="transformer-compile: unroll the blocks instead of "
                                           "scan.")] = False,
    diffusers: Annotated[bool, typer.Option("--diffusers", help="ttfi: also time diffusers' pipeline (needs "
                                            "\\[parity]).")] = False,
    compile_cache: o.CompileCacheOpt = None,
    effort: o.EffortOpt = o.Effort.default,
    no_save: o.NoSaveOpt = False,
    no_store: Annotated[bool, typer.Option("--no-store", help="pipeline: no executable store; jit-compile every "
                                           "program on the first call. "
                                           "Default: load stored executables, compile and store the missing ones, "
                                           "as generate does.")] = False,
    lora: o.LoraOpt = [],  # noqa: B006 (typer reads the default; it is never mutated)
    ranks: Annotated[str | None, typer.Option("--ranks", help="lora: the LoRA ranks to time, comma-separated "
                                              "\\[default: 16,64].")] = None,
    transformer: o.TransformerOpt = None,
    vae: o.VaeOpt = None,
    as_json: o.JsonOpt = False,
) -> None:
    """Time the phases of a run: load, compile, text encoding, denoising, decoding.

    pipeline (the default phase) loads the checkpoint, makes a first call and then --reps timed
    calls; compile is the first call's extra time over the steady state. By default the first
    call loads each program from the executable store (--compile-cache), compiling and storing
    the missing ones, as generate and edit do, and the result says per program which it was;
    --no-store times plain jit compilation instead.

    load times loading each component from safetensors and from converted copies (flat, Orbax),
    each in a fresh process, beside `cat` of the same files, filling as much new memory, and
    diffusers' from_pretrained plus touching every page; peak memory too.

    ttfi times process start to PNG on disk, each run a fresh `flux2klein generate`, cold
    (empty XLA cache and executable store) and warm (both filled), optionally beside diffusers.

    transformer-compile lowers and compiles one transformer forward at the model's real
    geometry from abstract shapes (no weights needed).

    lora times loading the transformer plain and with a random LoRA of each --ranks on every
    linear module, merged at load; the forms interleaved rep by rep.

    decode times the VAE decoder alone on random latents of --height x --width (compare the
    full decoder with `--vae small-decoder`).

    Examples:

      flux2klein bench --model 4b --height 1024 --width 1024 --bs 4 --reps 5

      flux2klein bench --model tiny --height 256 --width 256 --json

      flux2klein bench --model medium-dir --phase ttfi --height 512 --width 512 --steps 4 --dtype fp32 --diffusers

      flux2klein bench --model 9b --phase transformer-compile --reps 5 --json

      flux2klein bench --model 9b-kv --refs 4 --kv --height 1024 --width 1024

      flux2klein bench --model 4b --refs 1024x1024,768x1024 --height 1024 --width 1024

      flux2klein bench --model 9b --mesh fsdp=4 --bs 8

      flux2klein bench --model 9b --tpu v6-4 --bs 8

      flux2klein bench --model 4b --compile-cache /shared/executables --no-save

      flux2klein bench --model 4b --no-store

      flux2klein bench --model 4b --phase lora --ranks 16,64 --reps 3

      flux2klein bench --model 4b --phase decode --vae small-decoder --dtype fp32
    """
    with user_errors(SHAPE_FLAGS):
        from flux2klein_cli.core.runs.bench.run import BenchOptions, run_bench

        opts = BenchOptions(
            model=model, phase=phase.value, height=height, width=width, batch=bs, steps=steps, reps=reps,
            dtype=dtype.value, refs=refs, kv=kv, mesh=mesh, tpu=tpu, unrolled=unrolled, diffusers=diffusers,
            compile_cache=compile_cache, effort=effort.value, save=not no_save, store=not no_store, lora=tuple(lora),
            ranks=ranks, transformer=transformer, vae=vae,
        )
        result = run_bench(opts, note=note, progress=None if as_json else note, warn=warn,
                           busy=nullcontext if as_json else status)
    if as_json:
        emit_json(result)
    elif phase == "steps":
        for name, form in result["forms"].items():
            output.result(f"{name}: {form['median']:.3f} s median "
                          f"({form['per_step']['median']:.3f} s/step), {form['cost']:+.1%}")
    elif phase == "transformer-compile":
        _compile_table(result)
    elif phase == "ttfi":
        _ttfi_table(result)
    elif phase == "load":
        _load_table(result)
    elif phase == "lora":
        _lora_table(result)
    elif phase == "decode":
        output.result(f"decode {result['width']}x{result['height']}, batch {result['batch']}, {result['dtype']}, "
                      f"decoder widths {result['decoder_widths']}: {result['decode_s']['min']:.3f} s min, "
                      f"{result['decode_s']['median']:.3f} s median (compile {result['compile_s']:.1f} s)")
    elif result.get("timed") is False:
        _plan_table(result)
    else:
        _pipeline_table(result)


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**30:.3f}"


def _plan_table(result: dict[str, Any]) -> None:
    table = Table(title=f"{result['model']} for {result['slice']['preset']}: {result['width']}x{result['height']}, "
                        f"batch {result['batch']}, {result['steps']} steps, {result['dtype']} (compiled, not run)")
    for column in ("program", "store", "compile s", "peak GiB/chip", "GFLOP", "GB accessed", "est. ms"):
        table.add_column(column, justify="left" if column in ("program", "store") else "right")
    for p in result["programs"]:
        cost = p["cost"]
        table.add_row(p["name"], STORE_ACTIONS.get(p["status"], p["status"]), f"{p['compile_s']:.2f}",
                      _gib(p["needed_bytes_per_device"]),
                      f"{cost['flops'] / 1e9:.2f}" if "flops" in cost else "",
                      f"{cost['bytes_accessed'] / 1e9:.3f}" if "bytes_accessed" in cost else "",
                      f"{cost['optimal_seconds'] * 1e3:.3g}" if "optimal_seconds" in cost else "")
    show_table(table)
    output.result(result["verdict"]["text"])
    estimate = result["estimate"]
    if estimate is not None:
        output.result(f"per image: {estimate['per_image_s'] * 1e3:.3g} ms, {estimate['kind']}")
    output.result(result["note"])


def _compile_table(result: dict[str, Any]) -> None:
    table = Table(title=f"{result['model']} transformer-compile ({result['layers']}, {result['width']}x"
                        f"{result['height']}, batch {result['batch']})")
    for column in ("step", "min s", "median s"):
        table.add_column(column, justify="left" if column == "step" else "right")
    for key in ("lower_s", "compile_s", "total_s"):
        table.add_row(key.removesuffix("_s"), f"{result[key]['min']:.2f}", f"{result[key]['median']:.2f}")
    show_table(table)


def _pipeline_table(result: dict[str, Any]) -> None:
    refs = result["references"]
    edit = f", {len(refs)} reference(s) ({', '.join(refs)})" if refs else ""
    runs = {"plain": result} | ({"kv": result["kv"]} if "kv" in result else {})
    table = Table(title=f"{result['model']} {result['width']}x{result['height']}, batch {result['batch']}, "
                        f"{result['steps']} steps, {result['dtype']}{edit}")
    table.add_column("phase")
    for name in runs:
        prefix = f"{name} " if len(runs) > 1 else ""
        table.add_column(f"{prefix}min s", justify="right")
        table.add_column(f"{prefix}median s", justify="right")

    def row(label: str, cell: Any) -> None:
        table.add_row(label, *[text for run in runs.values() for text in cell(run)])

    def timing(t: dict[str, float] | None) -> tuple[str, str]:
        return ("", "") if t is None else (f"{t['min']:.3f}", f"{t['median']:.3f}")

    table.add_row("load", f"{result['load_s']:.2f}")
    row("compile (first call extra)", lambda r: (f"{r['compile_s']:.2f}", ""))
    for phase in dict.fromkeys(p for r in runs.values() for p in r["phases"]):
        row(phase, lambda r, phase=phase: timing(r["phases"].get(phase)))
    row("run", lambda r: timing(r["run_s"]))
    row("per image", lambda r: ("", f"{r['per_image_s']:.3f}"))
    show_table(table)
    devices = result.get("devices")
    if devices and devices["count"] > 1:
        per = ", ".join(f"{d}: {b / 2**20:.1f} MiB" for d, b in devices["parameter_bytes"].items())
        output.result(f"parameters per device ({devices['count']} devices, mesh {devices['mesh']}): {per}")
    _executables_table(result, runs)
    for name, run in runs.items():
        if run.get("timed_compiles"):
            prefix = f"{name}: " if len(runs) > 1 else ""
            output.result(f"{prefix}{len(run['timed_compiles'])} XLA program(s) compiled during the timed calls: "
                         f"{', '.join(run['timed_compiles'])}")
    if "kv_speedup" in result:
        s, reuse = result["kv_speedup"], result["kv_reuse"]
        output.result(f"KV speed-up: transformer {s['transformer']:.2f}x (bound {s['bound']:.2f}x, "
                     f"{100 * s['of_bound']:.0f}% of it), whole run {s['run']:.2f}x; reusing one cache over "
                     f"{reuse['prompts']} prompts saves {100 * reuse['saving']:.0f}%")


STORE_ACTIONS = {"hit": "hit (loaded)", "miss": "compiled", "recompiled": "recompiled"}


def _executables_table(result: dict[str, Any], runs: dict[str, dict[str, Any]]) -> None:
    """Per program of each run: what the executable store did on the first call."""
    store = result.get("store")
    if store is None:
        output.result("executables: no store (--no-store): jit-compiled on the first call")
        return
    saving = "" if store["save"] else ", --no-save"
    table = Table(title=f"executables ({store['root']}{saving})")
    if len(runs) > 1:
        table.add_column("run")
    for column in ("program", "store", "seconds", "saved"):
        table.add_column(column, justify="right" if column == "seconds" else "left")
    for name, run in runs.items():
        for p in run.get("executables") or []:
            cells = [p["name"], STORE_ACTIONS.get(p["status"], p["status"]), f"{p['seconds']:.2f}",
                     "yes" if p.get("saved") else ""]
            table.add_row(*([name] if len(runs) > 1 else []), *cells)
    show_table(table)


def _ttfi_table(result: dict[str, Any]) -> None:
    table = Table(title=f"time to first image: {result['model']} {result['width']}x{result['height']}, "
                        f"{result['steps']} steps, {result['dtype']}")
    for column in ("run", "min s", "median s", "vs diffusers"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for key, ratio in (("ours_cold_s", "cold_ratio"), ("ours_warm_s", "warm_ratio"), ("diffusers_s", None)):
        if key in result:
            r = f"{result[ratio]:.2f}x" if ratio and ratio in result else ""
            table.add_row(key.removesuffix("_s").replace("_", " "), f"{result[key]['min']:.2f}",
                          f"{result[key]['median']:.2f}", r)
    show_table(table)


def _load_table(result: dict[str, Any]) -> None:
    table = Table(title=f"load {result['model']} ({result['dtype']}, median of {result['reps']})")
    for column in ("component", "path", "median s", "peak / bytes"):
        table.add_column(column, justify="left" if column in ("component", "path") else "right")
    for name, component in result["components"].items():
        for kind in ("safetensors", "flat", "orbax", "cat", "fill", "diffusers"):
            if kind in component:
                peak = component[kind].get("peak_ratio")
                table.add_row(name, kind, f"{component[kind]['seconds']['median']:.3f}",
                              "" if peak is None else f"{peak:.2f}x")
    show_table(table)


def _lora_table(result: dict[str, Any]) -> None:
    table = Table(title=f"load the transformer with LoRAs merged ({result['dtype']}, {result['reps']} reps "
                        "interleaved)")
    for column in ("form", "min s", "median s", "extra median s", "LoRA MB"):
        table.add_column(column, justify="left" if column == "form" else "right")
    for form, entry in result["forms"].items():
        extra = entry.get("extra_s")
        table.add_row(form, f"{entry['seconds']['min']:.2f}", f"{entry['seconds']['median']:.2f}",
                      "" if extra is None else f"{extra['median']:+.2f}",
                      "" if "file_mb" not in entry else f"{entry['file_mb']:.1f}")
    show_table(table)
