"""`flux2klein convert`: a snapshot as a converted directory in the target dtype (a complete `--model`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.progress import TaskID

from flux2klein_cli.cli.output import emit_json, note, stderr, user_errors
from flux2klein_cli.cli.progress import wanted


def convert(
    model: str = typer.Argument(..., help="Alias, hub repo id or snapshot directory to convert."),
    out: Path = typer.Option(
        None, "--out", "-o",
        help="Directory to write (default: <flux2klein cache>/converted/<model>-<dtype>).",
    ),
    dtype: str = typer.Option("bf16", "--dtype", help="Stored parameter dtype: bf16 or fp32."),
    layout: str = typer.Option(
        "flat", "--layout",
        help="flat: one memory-mapped file per model, written in small pieces (the least memory to "
             "convert); orbax: an Orbax checkpoint of plain zarr arrays, for tools built around Orbax. "
             "Both load without copying on a CPU host.",
    ),
    mesh: str = typer.Option(None, "--mesh", help="orbax: one chunk file per shard of this mesh's parameter "
                             "shardings, e.g. fsdp=4 (flat files hold whole arrays; each device reads its slice)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
    revision: str = typer.Option(None, "--revision", help="Hub branch, tag or commit (default: main)."),
    offline: bool = typer.Option(False, "--offline", help="Use the local Hugging Face cache only."),
    lora: list[str] = typer.Option([], "--lora", metavar="PATH_OR_REPO[:SCALE]",
                                   help="Merge this LoRA into the transformer (repeatable; as generate --lora)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Write MODEL's transformer, text encoder and VAE in DTYPE and JAX layout, plus a manifest.

    The output directory holds everything a run needs (configs, tokenizer, scheduler), so it
    is a complete --model; loading it puts each parameter straight into its dtype and
    sharding, with nothing to convert or transpose. A CPU host uses the mapped files' pages as
    the parameters, without copying them. Tensors are converted one at a time, into a
    temporary directory renamed into place at the end: an interrupted convert leaves nothing
    that --model would accept. The path is printed on stdout.

    Example: flux2klein convert 4b --out ~/models/klein-4b-bf16

    Example: flux2klein convert 4b --lora style.safetensors:0.8 --out ~/models/klein-4b-style
    """
    with user_errors():
        from flux2klein_cli.core.errors import UserInputError
        from flux2klein_cli.core.snapshot import flux2klein_cache_dir, resolve
        from flux2klein_cli.core.weights.convert import convert_snapshot_to
        from flux2klein_cli.core.weights.converted import DTYPE_NAMES, LAYOUTS

        if dtype not in DTYPE_NAMES:
            raise UserInputError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_NAMES)}")
        if layout not in LAYOUTS:
            raise UserInputError(f"unknown layout {layout!r}: use one of {', '.join(LAYOUTS)}")
        run_on, rule = None, None
        if mesh:
            from flux2klein_cli.core.distributed import DeviceOptions, run_mesh
            from flux2klein_cli.core.sharding import parameter_rule

            run_on = run_mesh(DeviceOptions(mesh=mesh))
            rule = parameter_rule(run_on) if run_on is not None else None
        from flux2klein_cli.core.lora.files import LoraSpec
        from flux2klein_cli.core.lora.merge import LoraDeltas

        deltas = LoraDeltas.read([LoraSpec.parse(text) for text in lora])  # a bad LoRA fails before any work
        resolved = resolve(model, revision=revision, offline=offline, download=True,
                           progress=note)
        slug = _slug(model, resolved.repo_id, resolved.revision)
        target = out or flux2klein_cache_dir() / "converted" / f"{slug}-{dtype}"
        start = time.perf_counter()
        with _progress_bar(enabled=wanted(as_json)) as update:
            manifest = convert_snapshot_to(resolved, target, dtype=dtype, layout=layout, force=force, model=model,
                                           progress=update, mesh=run_on, lora=deltas,
                                           **({"sharding_rule": rule} if rule is not None else {}))
        seconds = time.perf_counter() - start
    if as_json:
        emit_json({
            "path": str(Path(target).expanduser().absolute()),
            "source": {k: v for k, v in manifest["source"].items() if k != "files"},
            "dtype": dtype,
            "layout": layout,
            "components": {n: {k: c[k] for k in ("parameters", "bytes")} for n, c in manifest["components"].items()},
            "seconds": round(seconds, 3),
            "lora": manifest.get("lora", []),
        })
        return
    note(f"converted in {seconds:.1f} s")
    typer.echo(str(Path(target).expanduser().absolute()))


def _slug(model: str, repo_id: str | None, revision: str | None) -> str:
    name = repo_id.replace("/", "--") if repo_id else Path(model).expanduser().resolve().name
    return f"{name}@{revision[:12]}" if revision else name


@contextmanager
def _progress_bar(*, enabled: bool) -> Iterator[Callable[[str, int, int], None] | None]:
    """A rich progress bar on stderr, one row per component (nothing with --json)."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    tasks: dict[str, TaskID] = {}
    with Progress(TextColumn("{task.description:>12}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=stderr, transient=True) as progress:

        def update(component: str, done: int, total: int) -> None:
            if component not in tasks:
                tasks[component] = progress.add_task(component, total=total)
            progress.update(tasks[component], completed=done)

        yield update
