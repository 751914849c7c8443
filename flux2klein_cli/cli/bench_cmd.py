"""`flux2klein bench`: timings, as a table on stdout or one JSON object."""

from __future__ import annotations

import typer
from rich.table import Table

from flux2klein_cli.cli.output import emit_json, stderr, stdout, user_errors

PHASES = ("transformer-compile",)


def bench(
    model: str = typer.Option("4b", "--model", "-m", help="Model alias whose geometry to use (4b, 9b, ...)."),
    phase: str = typer.Option("transformer-compile", "--phase", help=f"What to time: {', '.join(PHASES)}."),
    height: int = typer.Option(1024, "--height", help="Image height in pixels (multiple of 16)."),
    width: int = typer.Option(1024, "--width", help="Image width in pixels (multiple of 16)."),
    bs: int = typer.Option(1, "--bs", help="Batch size."),
    reps: int = typer.Option(3, "--reps", help="Repetitions; min and median are reported."),
    unrolled: bool = typer.Option(False, "--unrolled", help="Unroll the block loop instead of scanning it."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Time one phase of a run.

    transformer-compile lowers and compiles one transformer forward at the model's real
    geometry from abstract shapes (no weights needed), with the blocks scanned or unrolled.

    Example: flux2klein bench --model 4b --phase transformer-compile --reps 5 --json
    """
    with user_errors():
        from flux2klein_cli.core.bench import summarize, transformer_compile_seconds
        from flux2klein_cli.core.errors import UserInputError
        from flux2klein_cli.core.registry import spec_for

        spec = spec_for(model)
        if phase not in PHASES:
            raise UserInputError(f"unknown phase {phase!r}: use one of {', '.join(PHASES)}")
        if height % 16 or width % 16 or height < 16 or width < 16:
            raise UserInputError(f"height and width must be positive multiples of 16, got {height}x{width}")
        if bs < 1 or reps < 1:
            raise UserInputError("--bs and --reps must be at least 1")
        runs = []
        for i in range(reps):
            runs.append(transformer_compile_seconds(
                spec.transformer, scan=not unrolled, batch=bs, height=height, width=width
            ))
            if not as_json:
                stderr.print(f"rep {i + 1}/{reps}: {runs[-1]['total_s']:.2f} s")
    result = dict(
        model=spec.alias, phase=phase, layers="unrolled" if unrolled else "scan", height=height, width=width,
        batch=bs, **{key: summarize([r[key] for r in runs]) for key in ("lower_s", "compile_s", "total_s")},
    )
    if as_json:
        emit_json(result)
        return
    table = Table(title=f"{spec.alias} {phase} ({result['layers']}, {height}x{width}, batch {bs})")
    for column in ("step", "min s", "median s"):
        table.add_column(column, justify="left" if column == "step" else "right")
    for key in ("lower_s", "compile_s", "total_s"):
        table.add_row(key.removesuffix("_s"), f"{result[key]['min']:.2f}", f"{result[key]['median']:.2f}")
    stdout.print(table)
