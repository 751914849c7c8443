"""`flux2klein inspect`: load every component of a checkpoint with strict checks and report it."""

from __future__ import annotations

from typing import Annotated

import typer

from flux2klein_cli.cli import options as o
from flux2klein_cli.cli.output import Table, emit_json, error, note, show_table, user_errors
from flux2klein_cli.core.hub.registry import aliases


def inspect(
    model: Annotated[str, typer.Argument(help=f"Alias ({aliases()}), hub repo id, snapshot or converted "
                                         "directory; or a PNG written by generate, edit or batch.",
                                         metavar="MODEL|IMAGE.png")],
    dtype: o.DtypeOpt = o.Dtype.bf16,
    transformer: o.TransformerOpt = None,
    vae: o.VaeOpt = None,
    as_json: o.JsonOpt = False,
) -> None:
    """Load transformer, text encoder and VAE of a checkpoint, checking every key and shape.

    A missing shard, a truncated file, a missing or unexpected key, a wrong shape, a
    missing config, tokenizer or scheduler config is exit code 2 with a message that names
    the file and keys. Parameters holding NaN or inf are counted per component; any is
    exit code 2 after the report, naming the first ones.

    Given a PNG written by generate, edit or batch instead, print the parameters it carries (what
    generate --from reruns); a PNG without them is exit code 2.

    Examples:

      flux2klein inspect ~/models/FLUX.2-klein-4B --dtype bf16

      flux2klein inspect fox.png --json
    """
    from flux2klein_cli.core.runs import from_png

    if from_png.names_image(model):
        _image_parameters(model, as_json)
        return
    with user_errors():
        from flux2klein_cli.core.choices import jax_dtype
        from flux2klein_cli.core.hub.checkpoint import (
            load_models,
            non_finite_parameters,
            parameter_stats,
            stored_weights,
        )
        from flux2klein_cli.core.hub.components import composed_sources, resolve_composed
        from flux2klein_cli.core.hub.layout import Snapshot
        from flux2klein_cli.core.models.quantized import held_forms

        target = jax_dtype(dtype)
        snapshot = Snapshot.open(resolve_composed(model, transformer, vae))
        log = (lambda name, s: None) if as_json else (lambda name, s: note(f"loaded {name} in {s:.2f} s"))
        from flux2klein_cli.core.pipeline.pipeline import load_tokenizer_and_scheduler

        load_tokenizer_and_scheduler(snapshot)  # what generate needs besides the weights, checked as it does
        models = load_models(snapshot, dtype=target, on_loaded=log)

    components, non_finite = {}, {}
    for name in ("transformer", "text_encoder", "vae"):
        count, nbytes = parameter_stats(getattr(models, name))
        non_finite[name] = non_finite_parameters(getattr(models, name))
        components[name] = dict(parameters=count, bytes=nbytes, load_seconds=round(models.seconds[name], 4),
                                non_finite=sum(non_finite[name].values()))
        stored = stored_weights(snapshot.component(name)) if not snapshot.converted else None
        held = held_forms(getattr(models, name))
        if stored or held:  # a quantized file, or int8 weights: what is held in which form
            components[name]["weights"] = {**(stored or {}), "kept": held}
    result = dict(
        model=str(snapshot.root),
        pipeline=snapshot.pipeline_class,
        is_distilled=snapshot.is_distilled,
        kv=snapshot.kv,
        dtype=dtype.value,
        components=components,
        sources=composed_sources(snapshot.root),
    )
    if as_json:
        emit_json(result)
    else:
        table = Table(title=f"{snapshot.root.name} ({snapshot.pipeline_class}, {dtype})")
        for column in ("component", "parameters", "MiB", "load s", "NaN/inf"):
            table.add_column(column, justify="left" if column == "component" else "right")
        for name, c in components.items():
            table.add_row(name, f"{c['parameters']:,}", f"{c['bytes'] / 2**20:.1f}", f"{c['load_seconds']:.2f}",
                          f"{c['non_finite']:,}")
        show_table(table)
    bad = {f"{name}.{path}": n for name, paths in non_finite.items() for path, n in paths.items()}
    if bad:
        names = ", ".join(f"{path} ({n})" for path, n in list(bad.items())[:3]) + (" ..." if len(bad) > 3 else "")
        error(f"{len(bad)} parameter(s) hold NaN or inf values: {names}; this checkpoint makes black images")
        raise typer.Exit(2)


def _image_parameters(path: str, as_json: bool) -> None:
    from flux2klein_cli.core.runs import from_png
    from flux2klein_cli.core.runs.image_files import read_run_metadata

    with user_errors():
        parameters = read_run_metadata(path)
    if as_json:
        emit_json(parameters)
        return
    table = Table(title=path)
    table.add_column("parameter")
    table.add_column("value", overflow="fold")
    for name, value in parameters.items():
        table.add_row(name, from_png.shown(value))
    show_table(table)
