"""`flux2klein compile`: compile (or load) every program of a run and store the executables."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from flux2klein_cli.cli import options as o
from flux2klein_cli.cli.flags import SHAPE_FLAGS
from flux2klein_cli.cli.output import Table, emit_json, note, result, show_table, user_errors, warn
from flux2klein_cli.cli.params import float_option
from flux2klein_cli.core import choices
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.hub.registry import DEFAULT_MODEL


def compile_programs(
    model: Annotated[str, typer.Option("--model", "-m", help=o.model_help("; an alias needs no download (only "
                                                                          "configs are read)"))] = DEFAULT_MODEL,
    height: Annotated[int | None, typer.Option("--height", help="Image height in pixels \\[default: the "
                                               "model's].")] = None,
    width: Annotated[int | None, typer.Option("--width", help="Image width in pixels \\[default: the "
                                              "model's].")] = None,
    bs: Annotated[int, typer.Option("--bs", help="Images per run (the denoise and decode batch).")] = 1,
    prompts: Annotated[int, typer.Option("--prompts", help="Distinct prompts per run (the text encoder's "
                                         "batch).")] = 1,
    steps: o.StepsOpt = None,
    guidance: Annotated[float | None, float_option("--guidance", help="Guidance; above 1 on a base model compiles "
                                                   "CFG.")] = None,
    refs: o.RefsOpt = None,
    kv: Annotated[bool, typer.Option("--kv", help="KV edit: the references-only pass and denoising against its "
                                     "cache (9b-kv).")] = False,
    mesh: Annotated[str | None, typer.Option("--mesh", help="Mesh over this host's devices, e.g. fsdp=4 or "
                                             "data=2,fsdp=2.")] = None,
    tpu: Annotated[str | None, typer.Option("--tpu", help="TPU preset (v6e-4, v6-4, v5litepod-8, v5p-8, v4-8, "
                                            "v7-2, v6e:2x2 ...): without that TPU here, compile for its "
                                            "topology.")] = None,
    compile_cache: o.CompileCacheOpt = None,
    cache_dir: o.OldCacheDirOpt = None,
    sequential: Annotated[bool, typer.Option("--sequential", help="Compile one program at a time.")] = False,
    no_save: Annotated[bool, typer.Option("--no-save", help="Compile without storing the executables.")] = False,
    effort: o.EffortOpt = o.Effort.default,
    dtype: o.DtypeOpt = o.Dtype.bf16,
    quantize: Annotated[o.Quantize, o.choice_option(
        o.Quantize, choices.check_quantize, "--quantize",
        help="int8: compile for the model as `convert --quantize int8` writes it (a converted int8 model "
             "is compiled so without it).")] = o.Quantize("none"),
    max_sequence_length: o.MaxSequenceOpt = DEFAULTS.max_sequence_length,
    transformer: o.TransformerOpt = None,
    vae: o.VaeOpt = None,
    as_json: o.JsonOpt = False,
) -> None:
    """Compile every program a run needs and store the executables for later runs.

    Text encoder, denoise loop, VAE decode and one VAE encode per reference size are lowered
    from the model's configs alone (no weights), compiled in parallel, and serialized to the
    store; stored ones are loaded instead. With --tpu on a host without that TPU, programs are
    compiled for its topology (needs the \\[tpu] extra) and memory per device is held against
    the chip's HBM: fits, or does not fit and by how much.

    Examples:

      flux2klein compile --model tiny --height 256 --width 256

      flux2klein compile --model 9b --height 1024 --width 1024 --bs 8 --tpu v6-4 --json

      flux2klein compile --model 9b --height 1024 --width 1024 --bs 8 --tpu v6-4 --effort fast

      flux2klein compile --model 4b --refs 1024x1024,768x1024 --compile-cache /shared/executables

      flux2klein compile --model 9b-kv --height 1024 --width 1024 --refs 4 --kv
    """
    with user_errors(SHAPE_FLAGS):
        from flux2klein_cli.core.runs.compile import CompileOptions, run_compile

        opts = CompileOptions(model=model, height=height, width=width, batch=bs, prompts=prompts, steps=steps,
                              guidance=guidance, refs=refs, kv=kv, mesh=mesh, tpu=tpu,
                              compile_cache=o.compile_cache(compile_cache, cache_dir), sequential=sequential,
                              dtype=dtype.value, max_sequence_length=max_sequence_length, save=not no_save,
                              effort=effort.value, transformer=transformer, vae=vae, quantize=quantize.value)
        from flux2klein_cli.cli.progress import StepBar, wanted

        bar = StepBar("programs", unit="program") if wanted(as_json) else None

        def say(message: str) -> None:  # above the bar, which redraws below it
            if bar is not None and bar.bar is not None:
                bar.bar.write(message, file=sys.stderr)
            else:
                note(message)

        try:
            report = run_compile(opts, progress=say, on_done=bar,
                                 warn=warn)
        finally:
            if bar is not None:
                bar.close()
    if as_json:
        emit_json(report)
    else:
        _table(report)


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:,.1f}"


def _table(report: dict[str, Any]) -> None:
    target = report["target"]
    where = report.get("tpu", {}).get("preset") or f"{target['device_kind']} x{target['device_count']}"
    table = Table(title=f"{report['model']} {report['width']}x{report['height']}, batch {report['batch']}, "
                        f"{report['steps']} steps on {where}, {target.get('effort', 'default')} effort")
    for column in ("program", "status", "lower s", "compile s", "load s", "peak MiB/device", "with weights MiB"):
        table.add_column(column, justify="left" if column in ("program", "status") else "right")
    for p in report["programs"]:
        hit = p["status"] == "hit"
        table.add_row(p["name"], p["status"], "" if hit else f"{p['lower_s']:.2f}", f"{p['compile_s']:.2f}",
                      f"{p['seconds']:.2f}" if hit else "", _mib(p["memory"].get("peak")),
                      _mib(p["needed_bytes_per_device"]))
    show_table(table)
    result(f"{report['wall_s']:.2f} s in all ({'parallel' if report['parallel'] else 'sequential'}); "
           f"store: {report['store']}")
    if "verdict" in report:
        v = report["verdict"]
        result(v["text"], style="green" if v["fits"] else "red")
