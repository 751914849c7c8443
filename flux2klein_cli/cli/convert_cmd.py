"""`flux2klein convert`: a snapshot as a converted directory in the target dtype (a complete `--model`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import TaskID

from flux2klein_cli.cli import options as o
from flux2klein_cli.cli.output import emit_json, note, stderr, user_errors
from flux2klein_cli.cli.progress import wanted
from flux2klein_cli.core import choices


def convert(
    model: Annotated[str, typer.Argument(help="Alias, hub repo id or snapshot directory to convert.")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Directory to write (default: <flux2klein "
                                             "cache>/converted/<model>-<dtype>).")] = None,
    dtype: Annotated[o.Dtype, o.choice_option(o.Dtype, choices.check_dtype, "--dtype", help="Stored parameter "
                                              "dtype.")] = o.Dtype.bf16,
    layout: Annotated[o.Layout, o.choice_option(
        o.Layout, choices.check_layout, "--layout",
        help="flat: one memory-mapped file per model, written in small pieces (the least memory to convert); "
             "orbax: an Orbax checkpoint of plain zarr arrays, for tools built around Orbax. Both load without "
             "copying on a CPU host.")] = o.Layout(choices.DEFAULT_LAYOUT),
    quantize: Annotated[o.Quantize, o.choice_option(
        o.Quantize, choices.check_quantize, "--quantize",
        help="int8: the transformer's and text encoder's block linears stored as int8 per output channel with "
             "float32 scales (about half the bytes; computed weight-only, docs/models.md). Flat layout only.")
    ] = o.Quantize("none"),
    mesh: Annotated[str | None, typer.Option(
        "--mesh", help="orbax: one chunk file per shard of this mesh's parameter shardings, e.g. fsdp=4 (flat "
        "files hold whole arrays; each device reads its slice).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output directory that convert wrote "
                                        "(one with its manifest and nothing else).")] = False,
    revision: o.RevisionOpt = None,
    offline: Annotated[bool, typer.Option("--offline", help="Use the local Hugging Face cache only.")] = False,
    lora: Annotated[list[str], typer.Option(
        "--lora", metavar="PATH_OR_REPO[:SCALE]", help="LoRAs merged into the converted transformer (repeatable), "
        "for a model always run with the same ones.")] = [],  # noqa: B006 (never mutated)
    transformer: o.TransformerOpt = None,
    vae: o.VaeOpt = None,
    as_json: o.JsonOpt = False,
) -> None:
    """Write MODEL's transformer, text encoder and VAE in DTYPE and JAX layout, plus a manifest.

    The output directory holds everything a run needs (configs, tokenizer, scheduler), so it
    is a complete --model; loading it puts each parameter straight into its dtype and
    sharding, with nothing to convert or transpose. A CPU host uses the mapped files' pages as
    the parameters, without copying them. Tensors are converted one at a time, into a
    temporary directory renamed into place at the end: an interrupted convert leaves nothing
    that --model would accept. The path is printed on stdout.

    Example: flux2klein convert 4b --out ~/models/klein-4b-bf16

    Example: flux2klein convert 9b --quantize int8 --out ~/models/klein-9b-int8

    Example: flux2klein convert 4b --lora style.safetensors:0.8 --out ~/models/klein-4b-style
    """
    with user_errors():
        from flux2klein_cli.core.cache_paths import converted_dir
        from flux2klein_cli.core.hub.snapshot import resolve
        from flux2klein_cli.core.weights.convert import convert_snapshot_to

        run_on, rule = None, None
        if mesh:
            from flux2klein_cli.core.devices.distributed import DeviceOptions, run_mesh
            from flux2klein_cli.core.devices.sharding import parameter_rule

            run_on = run_mesh(DeviceOptions(mesh=mesh))
            rule = parameter_rule(run_on) if run_on is not None else None
        from flux2klein_cli.core.lora.files import LoraSpec
        from flux2klein_cli.core.lora.merge import LoraDeltas

        deltas = LoraDeltas.read([LoraSpec.parse(text) for text in lora])  # a bad LoRA fails before any work
        resolved = resolve(model, revision=revision, offline=offline, download=True,
                           progress=note)
        if transformer or vae:
            from dataclasses import replace

            from flux2klein_cli.core.hub.components import compose, resolve_overrides

            sources = resolve_overrides(transformer, vae, offline=offline, download=True)
            resolved = replace(resolved, path=compose(resolved.path, sources))
        slug = _slug(model, resolved.repo_id, resolved.revision)
        suffix = dtype.value if quantize.value == "none" else f"{dtype.value}-{quantize.value}"
        target = out or converted_dir() / f"{slug}-{suffix}"
        start = time.perf_counter()
        with _progress_bar(enabled=wanted(as_json)) as update:
            manifest = convert_snapshot_to(resolved, target, dtype=dtype.value, layout=layout.value, force=force,
                                           model=model, progress=update, mesh=run_on,
                                           user_out=out is not None, lora=deltas, quantize=quantize.value,
                                           **({"sharding_rule": rule} if rule is not None else {}))
        seconds = time.perf_counter() - start
    if as_json:
        emit_json({
            "path": str(Path(target).expanduser().absolute()),
            "source": {k: v for k, v in manifest["source"].items() if k != "files"},
            "dtype": dtype.value,
            "layout": layout.value,
            "components": {n: {k: c[k] for k in ("parameters", "bytes")} for n, c in manifest["components"].items()},
            "seconds": round(seconds, 3),
            "lora": manifest.get("lora", []),
            "quantize": quantize.value,
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
