"""`flux2klein convert`: a diffusers snapshot as Orbax checkpoints in the target dtype (layout in
orbax_store.py).

Writing streams: parameters are read from the safetensors one at a time, converted to the
target dtype and layout, and handed to Orbax in small groups (`ocp.partial.save`), which are
merged into one checkpoint per component at the end (`ocp.partial.finalize`). Everything is
written into a temporary sibling directory renamed into place once complete (the manifest
and model_index.json last): an interrupted convert leaves no directory `--model` accepts, and
the next convert to the same place removes what a killed one left.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from flux2klein_cli.core.errors import CheckpointError, UserInputError
from flux2klein_cli.core.mesh import default_mesh
from flux2klein_cli.core.snapshot import CONVERTED_MANIFEST, Resolved, snapshot_files, snapshot_problems
from flux2klein_cli.core.weights.configs import read_config, read_json
from flux2klein_cli.core.weights.loader import ShardingRule, _replicate, iter_arrays
from flux2klein_cli.core.weights.orbax_store import (
    COPIED_COMPONENTS,
    DTYPE_NAMES,
    FORMAT,
    FORMAT_VERSION,
    MODEL_COMPONENTS,
    ORBAX_DIR,
    abstract_component,
    components,
    orbax_context,
    orbax_key,
)
from flux2klein_cli.core.weights.safetensors_io import SafetensorsCheckpoint

_GROUP_BYTES = 256 << 20  # parameters handed to Orbax per partial save
_TMP_MARK = ".convert-"


def convert(
    source: str | Path,
    out: str | Path,
    *,
    dtype: str = "bf16",
    mesh: Mesh | None = None,
    sharding_rule: ShardingRule = _replicate,
    force: bool = False,
    provenance: dict[str, Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    group_bytes: int = _GROUP_BYTES,
) -> dict[str, Any]:
    """Convert a diffusers-layout snapshot into an Orbax directory at `out`; return its manifest.

    `mesh` and `sharding_rule` lay the arrays out for the target sharding (each array's chunks
    follow its shards). `provenance` (repo id, revision, the name the user gave) goes into the
    manifest. `progress(component, bytes_done, bytes_total)` is called as parameters are written."""
    if dtype not in DTYPE_NAMES:
        raise UserInputError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_NAMES)}")
    source, out = Path(source).resolve(), Path(out).expanduser().absolute()
    if (source / CONVERTED_MANIFEST).is_file():
        raise UserInputError(f"{source} is already a converted directory; convert its source snapshot instead")
    problems = snapshot_problems(source)
    if problems:
        raise CheckpointError(f"{source}: incomplete snapshot: {'; '.join(problems)}")
    if out == source or source in out.parents:
        raise UserInputError(f"--out {out} must be outside the source snapshot {source}")
    if out.exists() and not force:
        raise UserInputError(f"{out} exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise UserInputError(f"{out} exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out)

    tmp = out.parent / f".{out.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        mesh = mesh or default_mesh()
        written: dict[str, Any] = {}
        for name in MODEL_COMPONENTS:
            written[name] = convert_component(
                name, source / name, tmp / name, DTYPE_NAMES[dtype], mesh, sharding_rule, group_bytes, progress
            )
        for name in COPIED_COMPONENTS:
            shutil.copytree(source / name, tmp / name)
        manifest = _manifest(source, dtype, mesh, written, provenance)
        # Written last, in this order: a directory without both is not a converted model.
        shutil.copyfile(source / "model_index.json", tmp / "model_index.json")
        (tmp / CONVERTED_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def convert_snapshot_to(
    resolved: Resolved,
    out: str | Path,
    *,
    dtype: str = "bf16",
    force: bool = False,
    model: str | None = None,
    mesh: Mesh | None = None,
    sharding_rule: ShardingRule = _replicate,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """`convert` of a resolved `--model`, its provenance (name, repo id, commit) in the manifest."""
    if resolved.kind == "converted":
        raise UserInputError(f"{resolved.path} is already a converted directory; convert its source snapshot")
    provenance = {"model": model, "kind": resolved.kind, "repo_id": resolved.repo_id, "revision": resolved.revision}
    return convert(resolved.path, out, dtype=dtype, mesh=mesh, sharding_rule=sharding_rule, force=force,
                   provenance=provenance, progress=progress)


def convert_component(
    name: str,
    src: Path,
    dst: Path,
    dtype: Any,
    mesh: Mesh,
    sharding_rule: ShardingRule,
    group_bytes: int,
    progress: Callable[[str, int, int], None] | None,
) -> dict[str, Any]:
    """One component folder of a snapshot -> `dst/config.json` (and its other JSON) plus `dst/orbax`,
    every parameter in `dtype`, laid out for `mesh` / `sharding_rule`; returns its manifest entry.
    Peak memory is about twice the largest parameter or group over the baseline (Orbax stages a
    host copy of what it writes)."""
    dst.mkdir(parents=True)
    for path in sorted(src.glob("*.json")):
        if not path.name.endswith(".safetensors.index.json"):
            shutil.copyfile(path, dst / path.name)
    config = read_config(src)
    model = abstract_component(name, config, dtype)
    _, abstract_state = nnx.split(model)
    flat = list(nnx.to_flat_state(abstract_state))
    total = sum(int(np.prod(v.get_value().shape)) * np.dtype(v.get_value().dtype).itemsize for _, v in flat)
    checkpoint = SafetensorsCheckpoint.open(src)
    arrays = iter_arrays(checkpoint, components()[name].plan_for(model), abstract_state, mesh, sharding_rule)

    target = dst / ORBAX_DIR
    # Orbax stages what it writes (a host copy of each array), so the peak is about twice the
    # largest parameter or group over the baseline: for the 4B transformer, whose largest stacked
    # parameter is 3.4 GB, 7.7 GB in all, against 7.75 GB for the whole model.
    done, group, group_size = 0, {}, 0
    with orbax_context() as ocp:
        for path, array in arrays:
            group[orbax_key(path)] = array
            group_size += array.nbytes
            if group_size >= group_bytes:
                ocp.partial.save(target, group)
                done += group_size
                group, group_size = {}, 0
                if progress:
                    progress(name, done, total)
        if group:
            ocp.partial.save(target, group)
            done += group_size
            if progress:
                progress(name, done, total)
        group = {}
        ocp.partial.finalize(target)
    return {
        "checkpoint": f"{name}/{ORBAX_DIR}",
        "parameters": sum(int(np.prod(v.get_value().shape)) for _, v in flat),
        "bytes": total,
        "config": config,
    }


def _manifest(source: Path, dtype: str, mesh: Mesh, components: dict[str, Any],
              provenance: dict[str, Any] | None) -> dict[str, Any]:
    from flux2klein_cli import __version__

    files = {}
    for rel, size in snapshot_files(source):
        entry: dict[str, Any] = {"bytes": size}
        blob = (source / rel).resolve().name
        # In the hub cache a weight file links to a blob named by its SHA-256: a free content hash.
        if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob):
            entry["sha256"] = blob
        files[rel] = entry
    index = read_json(source / "model_index.json")
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "flux2klein_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dtype": dtype,
        "mesh": {str(k): int(v) for k, v in mesh.shape.items()},
        "pipeline_class": index.get("_class_name"),
        "source": {"path": str(source), **(provenance or {}), "files": files},
        "components": components,
        "copied": [rel for rel, _ in snapshot_files(source) if rel.split("/")[0] in COPIED_COMPONENTS]
        + ["model_index.json"],
    }


def _replace(tmp: Path, out: Path) -> None:
    """Rename the finished directory into place; an existing one (--force) is moved aside first
    and removed only once the new one is there."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f".{out.name}.replaced-{uuid.uuid4().hex[:8]}"
    out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temporaries(out: Path) -> None:
    """Temporary directories of earlier converts to the same place whose process is gone (killed)."""
    for tmp in out.parent.glob(f".{out.name}{_TMP_MARK}*"):
        pid = tmp.name.removeprefix(f".{out.name}{_TMP_MARK}").split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

