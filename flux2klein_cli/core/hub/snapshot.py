"""Where a `--model` lives on disk: alias, hub repo id, local directory, converted directory, or `tiny`.

Hub models follow huggingface_hub's own rules, through its own API: HF_HOME / HF_HUB_CACHE
choose the cache, HF_HUB_OFFLINE (or `offline=True`) keeps everything local, and a cached
snapshot is used before the network is touched. Only what the pipeline reads is downloaded
(`model_index.json` and the five component folders): the klein repos also hold single-file
checkpoints at their root, which would double the download.

`tiny` (and `tiny-kv`, its KV-pipeline twin for `edit --kv`) is a small random-weight
checkpoint in the real layout that this package writes itself on first use (no torch, no
network) into the flux2klein cache: `$FLUX2KLEIN_CACHE`, else `$XDG_CACHE_HOME/flux2klein`, else `~/.cache/flux2klein`.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flux2klein_cli.core.cache_paths import generated_dir
from flux2klein_cli.core.errors import CheckpointError, FieldError, Flux2KleinError, UserInputError
from flux2klein_cli.core.hub.registry import COMPONENT_REPOS, MODELS, TINY_ALIAS, TINY_KV_ALIAS
from flux2klein_cli.core.paths import check_name_length
from flux2klein_cli.core.temporaries import temporary_dir

# Everything the pipeline reads; nothing at the repo root but the index.
ALLOW_PATTERNS = ["model_index.json", "transformer/*", "text_encoder/*", "tokenizer/*", "scheduler/*", "vae/*"]
WEIGHT_COMPONENTS = ("transformer", "text_encoder", "vae")
TINY_DIR_NAME = "tiny-v1"  # bump when the writer's output changes, so old caches are not reused
TINY_KV_DIR_NAME = "tiny-kv-v1"
# Generated aliases: cache folder, KV pipeline, seed.
GENERATED = {TINY_ALIAS: (TINY_DIR_NAME, False, 0), TINY_KV_ALIAS: (TINY_KV_DIR_NAME, True, 1)}
CONVERTED_MANIFEST = "flux2klein-manifest.json"  # marks a directory written by `flux2klein convert`
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Resolved:
    """A model found on disk, and where it came from."""

    path: Path
    kind: str  # "local", "converted", "generated", "hub-cache" (found cached) or "hub" (downloaded now)
    repo_id: str | None = None
    revision: str | None = None  # the commit hash of a hub snapshot


def fetch_command(model: str, revision: str | None = None) -> str:
    return f"flux2klein fetch {model}" + (f" --revision {revision}" if revision else "")


def hub_offline() -> bool:
    """huggingface_hub's offline switch (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE), as it reads it."""
    from huggingface_hub import constants

    return constants.is_offline_mode()


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_model(
    model: str,
    *,
    revision: str | None = None,
    offline: bool | None = None,
    download: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The local directory of `model`: what every model command passes to `Snapshot.open`.

    A local directory (snapshot or converted) is returned as is. A hub model (alias or repo id)
    comes from the cache; when it is missing or incomplete, `download=True` fetches it unless
    offline, and otherwise the error names the `flux2klein fetch` command that would."""
    return resolve(model, revision=revision, offline=offline, download=download, progress=progress).path


def resolve(
    model: str,
    *,
    revision: str | None = None,
    offline: bool | None = None,
    download: bool = False,
    progress: Callable[[str], None] | None = None,
    tqdm_class: Any = None,
) -> Resolved:
    """`resolve_model` with provenance (kind, repo id, commit) for `fetch --json` and manifests.
    `tqdm_class` draws a download's byte progress (huggingface_hub's own bars when None)."""
    if not model or not model.strip():
        raise UserInputError("empty model name: give an alias (e.g. 4b), a hub repo id or a directory")
    check_name_length(model, "model")
    local = Path(model).expanduser()
    if local.is_dir():
        if revision:
            raise FieldError("revision", f"applies to hub models, not to the local directory {model}")
        kind = "converted" if (local / CONVERTED_MANIFEST).is_file() else "local"
        return Resolved(local.resolve(), kind)
    if local.exists():
        raise UserInputError(f"{model}: not a directory (a model is a snapshot directory, an alias or a repo id)")
    name = model.strip().lower()
    if name in GENERATED:
        if revision:
            raise FieldError("revision", f"does not apply to {name} (a checkpoint written locally)")
        return Resolved(ensure_tiny(progress, kv=name == TINY_KV_ALIAS), "generated")
    if name in COMPONENT_REPOS:
        # A one-component repo (`fetch small-decoder`); `--vae small-decoder` reads it (core/hub/components.py).
        return _from_hub(model, COMPONENT_REPOS[name][1], revision, offline=hub_offline() or bool(offline),
                         download=download, tqdm_class=tqdm_class, patterns=COMPONENT_PATTERNS,
                         problems=component_problems)
    if name in MODELS:
        repo_id = MODELS[name].repo_id
    elif _REPO_ID.match(model):
        repo_id = model
    else:
        aliases = ", ".join([*MODELS, *GENERATED, *COMPONENT_REPOS])
        raise UserInputError(
            f"{model}: no such directory, and not a model alias ({aliases}) or a hub repo id (org/name)"
        )
    offline = hub_offline() or bool(offline)
    return _from_hub(model, repo_id, revision, offline=offline, download=download, tqdm_class=tqdm_class)


def _from_hub(model: str, repo_id: str, revision: str | None, *, offline: bool, download: bool,
              tqdm_class: Any = None, patterns: list[str] = ALLOW_PATTERNS,
              problems: Callable[[Path], list[str]] | None = None) -> Resolved:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    problems = problems or snapshot_problems
    fetch = fetch_command(model, revision)
    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    problem = f"{where} is not in the Hugging Face cache ({hub_cache_dir()})"
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                      local_files_only=True))
        missing = problems(path)
        if not missing:
            return Resolved(path, "hub-cache", repo_id, _commit_of(path))
        problem = f"the cached snapshot of {where} at {path} is incomplete: {'; '.join(missing)}"
    except IncompleteSnapshotError as e:
        problem = f"the cached snapshot of {where} is incomplete ({_first_line(e)})"
    except LocalEntryNotFoundError:
        pass

    if offline:
        raise CheckpointError(f"{problem}, and offline mode is on ({{field:offline}} or HF_HUB_OFFLINE=1); "
                              f"with network access, run: {fetch}")
    if not download:
        raise CheckpointError(f"{problem}; download it with: {fetch}")
    path = _download(repo_id, revision, tqdm_class, patterns)
    missing = problems(path)
    if missing:
        raise CheckpointError(f"{repo_id}: the downloaded snapshot at {path} is incomplete: {'; '.join(missing)}")
    return Resolved(path, "hub", repo_id, _commit_of(path))


def _download(repo_id: str, revision: str | None, tqdm_class: Any = None,
              patterns: list[str] = ALLOW_PATTERNS) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                      tqdm_class=tqdm_class))
    except GatedRepoError:
        raise UserInputError(
            f"{repo_id} is gated: accept its licence at https://huggingface.co/{repo_id} and log in "
            "(`hf auth login` or HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise UserInputError(f"{repo_id} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise UserInputError(f"{repo_id}: no such model repository on the hub (or it is private)") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise Flux2KleinError(f"downloading {repo_id} failed: {_first_line(e)}") from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _commit_of(path: Path) -> str | None:
    """Hub snapshots live in `snapshots/<commit>`."""
    return path.name if _COMMIT.match(path.name) else None


def snapshot_problems(root: Path) -> list[str]:
    """What is missing from a diffusers-layout snapshot, without reading any weights: the index,
    the component folders and configs, and every shard an index names (a broken link into the
    hub's blob store counts as missing)."""
    root = Path(root)
    problems = []
    if not (root / "model_index.json").is_file():
        problems.append("model_index.json is missing")
    for component in ("transformer", "text_encoder", "vae", "tokenizer", "scheduler"):
        if not (root / component).is_dir():
            problems.append(f"{component}/ is missing")
    for component in WEIGHT_COMPONENTS:
        folder = root / component
        if not folder.is_dir():
            continue
        if not (folder / "config.json").is_file():
            problems.append(f"{component}/config.json is missing")
        problems += _weight_problems(folder, component)
    if (root / "scheduler").is_dir() and not (root / "scheduler" / "scheduler_config.json").is_file():
        problems.append("scheduler/scheduler_config.json is missing")
    tokenizer = root / "tokenizer"
    if tokenizer.is_dir() and not any((tokenizer / n).is_file() for n in ("tokenizer.json", "vocab.json")):
        problems.append("tokenizer/ has no tokenizer.json or vocab.json")
    return problems


def _weight_problems(folder: Path, component: str) -> list[str]:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if not indexes:
        # A transformer may be one GGUF file (core/weights/gguf_file.py).
        if not any(p.is_file() for p in (*folder.glob("*.safetensors"), *folder.glob("*.gguf"))):
            return [f"{component}/ has no .safetensors weights"]
        return []
    try:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [f"{component}/{indexes[0].name} is unreadable"]
    missing = [s for s in shards if not (folder / s).is_file()]
    if not missing:
        return []
    shown = ", ".join(missing[:3]) + (f" (and {len(missing) - 3} more)" if len(missing) > 3 else "")
    return [f"{component}/ misses {len(missing)} of {len(shards)} shards listed in {indexes[0].name}: {shown}"]


def snapshot_files(root: Path) -> list[tuple[str, int]]:
    """Every file of a snapshot (relative path, bytes), links followed; hidden files skipped."""
    root = Path(root)
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        files.append((rel.as_posix(), path.stat().st_size))
    return files


def ensure_tiny(progress: Callable[[str], None] | None = None, *, kv: bool = False) -> Path:
    """The `tiny` (or, with `kv`, `tiny-kv`) checkpoint, written on first use. The writer works
    in a temporary directory (core/temporaries.py) that is renamed into place, so a cache entry
    is always complete, concurrent first uses do not clash, and a killed writer's leftovers are
    removed next time."""
    alias = TINY_KV_ALIAS if kv else TINY_ALIAS
    dir_name, kv, seed = GENERATED[alias]
    target = generated_dir(dir_name)
    cache = target.parent
    if (target / "model_index.json").is_file():
        return target
    from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint

    if progress:
        progress(f"writing the {alias} random-weight checkpoint to {target} (first use)")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        _remove_legacy_tiny_temporaries(cache, dir_name)
        with temporary_dir(cache, dir_name) as tmp:
            write_random_checkpoint(tmp, "tiny", seed=seed, kv=kv)
            try:
                tmp.rename(target)
            except OSError:
                if not (target / "model_index.json").is_file():  # not a lost race: a real failure
                    raise
    except OSError as e:
        raise Flux2KleinError(f"cannot write the {alias} checkpoint under {cache}: {e.strerror or e}") from None
    return target


def _remove_legacy_tiny_temporaries(cache: Path, dir_name: str) -> None:
    """Versions before core/temporaries.py named the writer's directory `.tiny-v1-RANDOM`, with no
    PID to check; one an hour old is a killed writer's (the write takes seconds)."""
    for path in cache.glob(f".{dir_name}-*"):
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > 3600:
                shutil.rmtree(path, ignore_errors=True)


def describe(resolved: Resolved) -> dict[str, Any]:
    """What `fetch --json` prints."""
    files = snapshot_files(resolved.path)
    return {
        "path": str(resolved.path),
        "kind": resolved.kind,
        "repo_id": resolved.repo_id,
        "revision": resolved.revision,
        "files": [name for name, _ in files],
        "bytes": sum(size for _, size in files),
    }


# What a one-component hub repo needs downloaded: its config and diffusers weights (the repo may
# also hold the same weights in another layout at its root, which would double the download).
COMPONENT_PATTERNS = ["config.json", "diffusion_pytorch_model*.safetensors*", "vae/*"]


def component_problems(root: Path) -> list[str]:
    """What a one-component snapshot lacks: its config or its weights."""
    folder = component_folder(root)
    if not (folder / "config.json").is_file():
        return ["config.json missing"]
    if not any(folder.glob("*.safetensors")):
        return ["no .safetensors weights"]
    return []


def component_folder(root: Path) -> Path:
    """A one-component repo keeps the component at its root or in `vae/`."""
    return root / "vae" if (root / "vae" / "config.json").is_file() else root
