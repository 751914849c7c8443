"""`flux2klein batch`: many images from one manifest, resumable, split across machines."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from flux2klein_cli.cli import options as o
from flux2klein_cli.cli.output import Table, emit_json, note, plain, result, show_table, status, user_errors, warn
from flux2klein_cli.cli.progress import StepBar, wanted
from flux2klein_cli.core.defaults import DEFAULTS
from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.hub.registry import DEFAULT_MODEL


class ItemBar:
    """`on_progress(finished, total, images)`: a bar over items with ETA, and images/s beside it."""

    def __init__(self, pause: Any, resume: Any) -> None:
        self.pause, self.resume = pause, resume
        self.bar: Any = None
        self.start = 0.0

    def __call__(self, finished: int, total: int, images: int) -> None:
        import time

        from tqdm import tqdm

        if self.bar is None:
            self.pause()
            self.bar = tqdm(total=total, desc="items", unit="item", file=sys.stderr, dynamic_ncols=True, leave=False,
                            mininterval=0, position=1)
            self.start = self.bar.start_t
        self.bar.update(finished - self.bar.n)
        elapsed = time.time() - self.start
        if elapsed > 0:
            self.bar.set_postfix_str(f"{images / elapsed:.2f} images/s", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            self.resume()


def _summary(report: Any) -> None:
    table = Table(title="batch")
    table.add_column("")
    table.add_column("", justify="right")
    rows = [("items", report.items), ("done now", report.ok), ("done before", report.skipped),
            ("failed", report.failed), ("bad lines", len(report.bad_lines)), ("images", report.images),
            ("images/s", f"{report.images_per_second:.2f}"), ("seconds", f"{report.seconds.get('total', 0.0):.1f}"),
            ("programs compiled", report.programs_compiled), ("programs loaded", report.programs_loaded)]
    if report.shard is not None:
        rows.insert(0, ("shard", report.shard))
    for name, value in rows:
        table.add_row(name, str(value))
    show_table(table)
    if report.interrupted:
        note("stopped: run the same command again to go on where it stopped")
    result(report.results)


def batch(
    manifest: Annotated[Path | None, typer.Argument(help="JSONL (one request object per line), CSV with a header, "
                                                   "or one prompt per line.", show_default=False)] = None,
    out_dir: Annotated[Path | None, typer.Option("--out-dir", help="Where the PNGs and results.jsonl go (and "
                                                 "what a rerun resumes from).")] = None,
    merge: Annotated[Path | None, typer.Option("--merge", help="Join DIR's shard results files into "
                                               "DIR/results.jsonl, and run nothing.", metavar="DIR")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help=o.MODEL_HELP_IMAGES)] = DEFAULT_MODEL,
    batch_size: Annotated[int, typer.Option("--bs", help="Images per device batch: lines of one shape run "
                                            "together up to this.")] = 1,
    shard: Annotated[str | None, typer.Option("--shard", metavar="I/N", help="Run shard I (from 0) of N: every "
                                              "N-th batch. Shards write their own results file.")] = None,
    output: Annotated[str, typer.Option("--output", "-o", help="Name template of lines without `output`: "
                                        "{index}, {seed}, {slug}, inside --out-dir.")] = "{index:05d}-{seed}.png",
    manifest_format: Annotated[str | None, typer.Option("--format", metavar="[jsonl|csv|text]", help="The manifest's "
                                                        "format \\[default: from its suffix, else its first line]")
                               ] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Stop (exit 2) on any bad line instead of skipping "
                                         "it.")] = False,
    height: o.HeightOpt = None,
    width: o.WidthOpt = None,
    steps: o.StepsOpt = None,
    guidance: o.GuidanceOpt = None,
    negative_prompt: o.NegativeOpt = "",
    seed: o.SeedOpt = 0,
    num_images: o.NumImagesOpt = 1,
    max_sequence_length: o.MaxSequenceOpt = DEFAULTS.max_sequence_length,
    dtype: o.DtypeOpt = o.Dtype.bf16,
    force: Annotated[bool, typer.Option("--force", help="Overwrite files at output names in a directory that has "
                                        "no results file yet.")] = False,
    mesh: o.MeshOpt = None,
    tpu: o.TpuOpt = None,
    coordinator: o.CoordinatorOpt = None,
    num_processes: o.NumProcessesOpt = None,
    process_id: o.ProcessIdOpt = None,
    compile_cache: o.CompileCacheOpt = None,
    no_save: o.NoSaveOpt = False,
    effort: o.EffortOpt = o.Effort.default,
    lora: o.LoraOpt = [],  # noqa: B006 (typer reads the default; it is never mutated)
    transformer: o.TransformerOpt = None,
    vae: o.VaeOpt = None,
    as_json: o.JsonOpt = False,
) -> None:
    """Generate many images from a manifest: lines of one shape run together, each shape compiled once.

    Each line's fields (prompt, negative_prompt, seed or seeds or num_images, height, width, steps, guidance,
    images, kv, output) fall back on the options. Finished items are recorded in DIR/results.jsonl; running
    the same command again skips them (a changed line is redone). The first Ctrl-C / SIGTERM finishes the
    current batch and exits 130; a second abandons it. Exit 0: all ok; 1: some failed or bad lines were
    skipped; 2: unusable manifest.

    Examples:

      flux2klein batch jobs.jsonl --out-dir renders --model 4b --bs 4

      flux2klein batch prompts.txt --out-dir renders --seed 7 --num-images 2 --json

      flux2klein batch jobs.jsonl --out-dir renders --shard 0/2   (and --shard 1/2 elsewhere)

      flux2klein batch --merge renders
    """
    from flux2klein_cli.core.runs.batch.results import merge_results

    with user_errors():
        if merge is not None:
            if manifest is not None or out_dir is not None:
                raise UserInputError("--merge DIR runs nothing: give it without MANIFEST and --out-dir")
            merged = merge_results(merge)
            if as_json:
                emit_json(merged.as_dict())
                return
            if merged.missing_shards:
                warn(f"no results file for shard(s) {', '.join(merged.missing_shards)}")
            note(f"{merged.items} items ({merged.ok} ok, {merged.failed} failed) from {len(merged.files)} file(s)")
            result(merged.results)
            return
        if manifest is None or out_dir is None:
            raise UserInputError("give MANIFEST and --out-dir DIR (or --merge DIR)")
    code = _run(manifest=manifest, out_dir=out_dir, as_json=as_json, shard=shard,
                devices=dict(mesh=mesh, tpu=tpu, coordinator=coordinator, num_processes=num_processes,
                             process_id=process_id),
                engine=dict(model=model, dtype=dtype.value, compile_cache=compile_cache, save_executables=not no_save,
                            effort=effort.value, transformer=transformer, vae=vae, lora=tuple(lora)),
                fields=dict(height=height, width=width, steps=steps, guidance=guidance,
                            negative_prompt=negative_prompt, seed=seed, num_images=num_images,
                            max_sequence_length=max_sequence_length),
                batch=dict(output=output, batch_size=batch_size, strict=strict, force=force, format=manifest_format))
    if code:
        raise typer.Exit(code)


def _run(*, manifest: Path, out_dir: Path, as_json: bool, shard: str | None, devices: dict[str, Any],
         engine: dict[str, Any], fields: dict[str, Any], batch: dict[str, Any]) -> int:
    from flux2klein_cli.core.devices.distributed import DeviceOptions, is_writer, native_stdout_to_stderr
    from flux2klein_cli.core.devices.runtime import configure_jax
    from flux2klein_cli.core.engine.engine import EngineOptions
    from flux2klein_cli.core.engine.plan import RunFields
    from flux2klein_cli.core.hub.snapshot import resolve_model
    from flux2klein_cli.core.runs.batch.grouping import Shard
    from flux2klein_cli.core.runs.batch.run import BatchOptions, run_batch

    configure_jax(warn)
    with user_errors(), native_stdout_to_stderr():
        opts = BatchOptions(engine=EngineOptions(devices=DeviceOptions(**devices), **engine), manifest=manifest,
                            out_dir=out_dir, defaults=RunFields(prompts=(), **fields),
                            shard=None if shard is None else Shard.parse(shard), **batch)
        if as_json or not wanted(as_json):
            report = run_batch(opts, resolve_model, warn=warn)
        else:
            with status("starting") as spinner:
                steps = StepBar(pause=spinner.stop, resume=lambda: None)
                items = ItemBar(pause=spinner.stop, resume=spinner.start)
                try:
                    report = run_batch(opts, resolve_model, warn=warn, on_step=steps, on_progress=items,
                                       on_phase=lambda phase: spinner.update(plain(phase)))
                finally:
                    steps.close()
                    items.close()
    if is_writer():
        if as_json:
            emit_json(report.as_dict())
        else:
            _summary(report)
    return report.exit_code
