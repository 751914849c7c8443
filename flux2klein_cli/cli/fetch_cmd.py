"""`flux2klein fetch`: resolve a model to a local snapshot (downloading it if needed); print its path."""

from __future__ import annotations

from typing import Annotated

import typer

from flux2klein_cli.cli import options as o
from flux2klein_cli.cli.output import emit_json, note, user_errors
from flux2klein_cli.cli.progress import wanted


def hub_tqdm_for(as_json: bool) -> object:
    from flux2klein_cli.cli.progress import hub_tqdm

    return hub_tqdm(enabled=wanted(as_json))


def fetch(
    model: Annotated[str, typer.Argument(help=o.model_help())],
    revision: o.RevisionOpt = None,
    offline: o.OfflineOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: path, revision, files, "
                                          "bytes.")] = False,
    lora: Annotated[bool, typer.Option("--lora", help="MODEL is a LoRA repo (its .safetensors, for --lora "
                                       "REPO).")] = False,
) -> None:
    """Find MODEL in the Hugging Face cache, else download it; print the snapshot path on stdout.

    Only model_index.json and the five component folders are downloaded. The cache is
    huggingface_hub's (HF_HOME, HF_HUB_CACHE); HF_HUB_OFFLINE=1 acts as --offline. Missing
    while offline: exit 2 and the command to run with network access. `tiny` is a small
    random-weight checkpoint written on first use, without network, into $FLUX2KLEIN_CACHE
    (default $XDG_CACHE_HOME/flux2klein, else ~/.cache/flux2klein).

    Example: path=$(flux2klein fetch 9b-kv)

    Example: flux2klein fetch --lora some-org/klein-style-lora
    """
    if lora:
        with user_errors():
            if revision:
                from flux2klein_cli.core.errors import UserInputError

                raise UserInputError("--revision is not supported with --lora (the repo's main branch is fetched)")
            from flux2klein_cli.core.lora.files import LoraSpec, fetch_lora, resolve_lora

            path = fetch_lora(model, offline=offline, download=True, tqdm_class=hub_tqdm_for(as_json))
            file = resolve_lora(LoraSpec(str(path)))
        if as_json:
            emit_json(dict(repo_id=model, path=str(path), file=str(file)))
        else:
            typer.echo(str(file))
        return
    with user_errors():
        from flux2klein_cli.cli.progress import hub_tqdm
        from flux2klein_cli.core.errors import CheckpointError
        from flux2klein_cli.core.hub.snapshot import describe, resolve, snapshot_problems

        resolved = resolve(model, revision=revision, offline=offline, download=True, progress=note,
                           tqdm_class=hub_tqdm(enabled=wanted(as_json)))
        if resolved.kind == "local":
            problems = snapshot_problems(resolved.path)
            if problems:
                raise CheckpointError(f"{resolved.path}: incomplete snapshot: {'; '.join(problems)}")
        elif resolved.kind == "converted":
            from flux2klein_cli.core.weights.converted_manifest import check_converted

            check_converted(resolved.path)
    if as_json:
        emit_json(describe(resolved))
        return
    # Only the path on stdout, so that `path=$(flux2klein fetch 4b)` works; no rich wrapping.
    typer.echo(str(resolved.path))
