"""What `generate` and `edit` share past their options (cli/options.py): the run and its report."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from flux2klein_cli.cli.output import emit_json, note, plain, result, status, user_errors, warn
from flux2klein_cli.cli.progress import PhaseLines, StepBar, wanted
from flux2klein_cli.core.errors import Flux2KleinError


@contextmanager
def _written_on_failure(as_json: bool) -> Iterator[None]:
    """With --json, a batch that failed midway still prints one object: the error and the images
    already written (core/runs/generate.py keeps them)."""
    try:
        yield
    except Flux2KleinError as e:
        if as_json and hasattr(e, "written"):
            from flux2klein_cli.cli.flags import message

            emit_json({"error": message(e), "outputs": e.written})
        raise


def given(ctx: typer.Context) -> set[str]:
    """The fields the user gave (on the command line or through their environment variable): each
    parameter's name, or the field its flag spells (core/fields.py: `--image` is `references`)."""
    from flux2klein_cli.core.fields import FIELDS

    def source(name: str) -> str:  # by name: Typer's click and the installed one differ
        found = ctx.get_parameter_source(name)
        return "DEFAULT" if found is None else found.name

    fields = {f.flag[2:].replace("-", "_"): name for name, f in FIELDS.items() if f.flag and f.flag.startswith("--")}
    return {fields.get(p.name, p.name) for p in ctx.command.params
            if p.name and source(p.name) not in ("DEFAULT", "DEFAULT_MAP")}


def with_png(ctx: typer.Context, source: Path | None, command: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """`--from IMAGE.png`: `arguments` (the command's, by field) with those the user did not give taken
    from the PNG (core/runs/from_png.py); without --from, `arguments` as they are."""
    if source is None:
        return arguments
    from flux2klein_cli.core.runs import from_png

    with user_errors():
        return from_png.overlay(from_png.parameters(source, command), arguments, given(ctx), source=source)


def run(*, prompt: str | None, prompt_file: Path | None, as_json: bool, devices: dict[str, Any],
        engine: dict[str, Any], fields: dict[str, Any], output: Path, force: bool) -> None:
    """Build core's options from the command's keyword arguments (`engine`: EngineOptions,
    `fields`: RunFields), run, and report: paths on stdout, or one JSON object (process 0 only)."""
    from flux2klein_cli.core.devices.distributed import DeviceOptions, native_stdout_to_stderr
    from flux2klein_cli.core.devices.runtime import configure_jax
    from flux2klein_cli.core.engine.engine import EngineOptions
    from flux2klein_cli.core.engine.plan import RunFields
    from flux2klein_cli.core.hub.snapshot import resolve_model
    from flux2klein_cli.core.runs.generate import GenerateOptions, read_prompts, run_generate

    configure_jax(warn)
    with user_errors(), _written_on_failure(as_json), native_stdout_to_stderr():
        opts = GenerateOptions(
            engine=EngineOptions(devices=DeviceOptions(**devices), **engine),
            fields=RunFields(prompts=tuple(read_prompts(prompt, prompt_file)), **fields),
            output=output, force=force)
        if as_json:  # progress as plain lines on stderr, one per phase
            report = run_generate(opts, resolve_model, warn=warn, on_phase=PhaseLines(note))
        else:
            with status("starting") as spinner:
                bar = StepBar(pause=spinner.stop, resume=spinner.start) if wanted(as_json) else None
                try:
                    report = run_generate(opts, resolve_model, warn=warn, on_step=bar,
                                          on_phase=lambda phase: spinner.update(plain(phase)))
                finally:
                    if bar is not None:
                        bar.close()
    if not report.writer:
        return
    if as_json:
        emit_json(report.as_dict())
        return
    seconds = report.seconds
    note(f"{len(report.outputs)} image(s) {report.width}x{report.height}, {report.steps} steps, "
         f"in {seconds['total']:.1f} s (load {seconds['load']:.1f} s, "
         f"executables {seconds.get('executables', 0.0):.1f} s, denoise {seconds['denoise']:.1f} s)")
    for path in report.outputs:
        result(path)
