"""What `generate` and `edit` share past their options (cli/options.py): the run and its report."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flux2klein_cli.cli.output import emit_json, note, plain, result, status, user_errors, warn
from flux2klein_cli.cli.progress import StepBar, wanted
from flux2klein_cli.core.errors import Flux2KleinError


@contextmanager
def _written_on_failure(as_json: bool) -> Iterator[None]:
    """With --json, a batch that failed midway still prints one object: the error and the images
    already written (core/runs/generate.py keeps them)."""
    try:
        yield
    except Flux2KleinError as e:
        if as_json and hasattr(e, "written"):
            emit_json({"error": str(e), "outputs": e.written})
        raise


def run(*, prompt: str | None, prompt_file: Path | None, as_json: bool, devices: dict[str, Any],
        **options: Any) -> None:
    """Build core's GenerateOptions from the command's keyword arguments, run, and report: paths on stdout,
    or one JSON object (process 0 only)."""
    from flux2klein_cli.core.devices.distributed import DeviceOptions, native_stdout_to_stderr
    from flux2klein_cli.core.devices.runtime import configure_jax
    from flux2klein_cli.core.hub.snapshot import resolve_model
    from flux2klein_cli.core.runs.generate import GenerateOptions, read_prompts, run_generate

    configure_jax(warn)
    with user_errors(), _written_on_failure(as_json), native_stdout_to_stderr():
        opts = GenerateOptions(prompts=read_prompts(prompt, prompt_file), devices=DeviceOptions(**devices), **options)
        if as_json:
            report = run_generate(opts, resolve_model, warn=warn)
        else:
            with status("starting") as spinner:
                bar = StepBar(pause=spinner.stop, resume=spinner.start) if wanted(as_json) else None
                try:
                    report = run_generate(opts, resolve_model, warn=warn, on_step=bar,
                                          on_phase=lambda phase: spinner.update(plain(phase)))
                finally:
                    if bar is not None:
                        bar.close()
    if not report.get("writer", True):
        return
    if as_json:
        emit_json(report)
        return
    seconds = report["seconds"]
    note(f"{len(report['outputs'])} image(s) {report['width']}x{report['height']}, {report['steps']} steps, "
                 f"in {seconds['total']:.1f} s (load {seconds['load']:.1f} s, denoise {seconds['denoise']:.1f} s)")
    for path in report["outputs"]:
        result(path)
