"""`flux2klein convert`: a diffusers snapshot as a converted directory in the target dtype, in the
flat or the Orbax layout (converted.py describes the directory and why there are two layouts).

Writing streams: parameters are read from the safetensors one at a time, converted to the
target dtype and JAX layout, and written either in pieces into the flat file
(flat_store.write_flat) or to Orbax in small groups (orbax_store.write_orbax). Everything is
written into a temporary sibling directory (core/temporaries.py) renamed into place once
complete (the manifest and model_index.json last): an interrupted convert removes it and leaves
no directory `--model` accepts, and the next convert to the same place removes what a killed
one left.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from flux2klein_cli.core.choices import DEFAULT_LAYOUT, check_dtype, check_layout, jax_dtype
from flux2klein_cli.core.choices import check_quantize as check_quantize_name
from flux2klein_cli.core.devices.mesh import default_mesh
from flux2klein_cli.core.devices.sharding import replicated_rule
from flux2klein_cli.core.errors import CheckpointError, FieldError, UserInputError
from flux2klein_cli.core.hub.snapshot import CONVERTED_MANIFEST, Resolved, snapshot_files, snapshot_problems
from flux2klein_cli.core.models.quantized import (
    QUANTIZED_STACKS,
    SCALE_DTYPE,
    quantized_embed_paths,
    quantized_linear_paths,
)
from flux2klein_cli.core.temporaries import stem, temporary_dir
from flux2klein_cli.core.weights.checkpoints import open_weights
from flux2klein_cli.core.weights.configs import read_config, read_json
from flux2klein_cli.core.weights.convert_target import (
    check_free_space,
    check_replaceable,
    target_dir,
    write_errors,
)
from flux2klein_cli.core.weights.converted import abstract_component, components, param_key
from flux2klein_cli.core.weights.converted_manifest import COPIED_COMPONENTS, FORMAT, FORMAT_VERSION, MODEL_COMPONENTS
from flux2klein_cli.core.weights.loader import Deltas, ShardingRule, check_plan, iter_arrays, read_into, weight_shapes
from flux2klein_cli.core.weights.prequantized import prepare
from flux2klein_cli.core.weights.quantize import quantized_writers
from flux2klein_cli.core.weights.quantized_file import QuantizedCheckpoint

QUANTIZED_COMPONENTS = ("transformer", "text_encoder")  # the VAE is small and convolutional
_GROUP_BYTES = 256 << 20  # parameters handed to Orbax per partial save


def convert(
    source: str | Path,
    out: str | Path,
    *,
    dtype: str = "bf16",
    layout: str = DEFAULT_LAYOUT,
    mesh: Mesh | None = None,
    sharding_rule: ShardingRule = replicated_rule,
    force: bool = False,
    provenance: dict[str, Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    group_bytes: int = _GROUP_BYTES,
    user_out: bool = True,
    lora: Any = None,
    quantize: str | None = None,
) -> dict[str, Any]:
    """Convert a diffusers-layout snapshot into a converted directory at `out`; return its manifest.

    `layout` is "flat" or "orbax" (see converted.py). For Orbax, `mesh` and `sharding_rule` lay
    the arrays out for the target sharding (each array's chunks follow its shards); a flat file
    serves any sharding. `provenance` (repo id, revision, the name the user gave) goes into the
    manifest. `progress(component, bytes_done, bytes_total)` is called as parameters are written.
    `user_out`: `out` was given by the user, so an unwritable one is bad input (exit 2), not a
    failure of the default place (exit 1). A symlinked `out` is written where it points.
    `lora` (core/lora/merge.py LoraDeltas) is merged into the transformer's (and text encoder's)
    weights as they are written, and recorded in the manifest. `quantize` ("int8"; flat layout only) stores the
    transformer's and text encoder's block linears as int8 with scales (core/weights/quantize.py),
    LoRAs merged before rounding."""
    check_dtype(dtype)
    check_layout(layout)
    quantize = check_quantize(quantize, layout)
    source = Path(source).resolve()
    if (source / CONVERTED_MANIFEST).is_file():
        raise UserInputError(f"{source} is already a converted directory; convert its source snapshot instead")
    problems = snapshot_problems(source)
    if problems:
        raise CheckpointError(f"{source}: incomplete snapshot: {'; '.join(problems)}")
    out = target_dir(source, out, force=force)
    needed = needed_bytes(source, dtype, quantize)
    with write_errors(out, needed, user_out=user_out):
        out.parent.mkdir(parents=True, exist_ok=True)
        check_free_space(out, needed)
        with temporary_dir(out.parent, out.name) as tmp:
            mesh = mesh or default_mesh()
            written: dict[str, Any] = {}
            for name in MODEL_COMPONENTS:
                written[name] = convert_component(
                    name, source / name, tmp / name, jax_dtype(dtype), mesh, sharding_rule, group_bytes, progress,
                    layout=layout, deltas=lora.for_component(name) if lora is not None else None,
                    quantize=quantize if name in QUANTIZED_COMPONENTS else None,
                )
            for name in COPIED_COMPONENTS:
                shutil.copytree(source / name, tmp / name)
            manifest = _manifest(source, dtype, layout, mesh, written, provenance)
            if quantize is not None:
                manifest["quantize"] = {"scheme": quantize, "components": list(QUANTIZED_COMPONENTS),
                                        "weights": "int8 per output channel, symmetric", "scales": "float32",
                                        "stacks": list(QUANTIZED_STACKS)}
            if lora is not None:
                manifest["lora"] = lora.records()
            # Written last, in this order: a directory without both is not a converted model.
            shutil.copyfile(source / "model_index.json", tmp / "model_index.json")
            (tmp / CONVERTED_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            _replace(tmp, out)
    return manifest


def convert_snapshot_to(
    resolved: Resolved,
    out: str | Path,
    *,
    dtype: str = "bf16",
    layout: str = DEFAULT_LAYOUT,
    force: bool = False,
    model: str | None = None,
    mesh: Mesh | None = None,
    sharding_rule: ShardingRule = replicated_rule,
    progress: Callable[[str, int, int], None] | None = None,
    user_out: bool = True,
    lora: Any = None,
    quantize: str | None = None,
) -> dict[str, Any]:
    """`convert` of a resolved `--model`, its provenance (name, repo id, commit) in the manifest."""
    if resolved.kind == "converted":
        raise UserInputError(f"{resolved.path} is already a converted directory; convert its source snapshot")
    from flux2klein_cli.core.hub.components import composed_sources

    provenance = {"model": model, "kind": resolved.kind, "repo_id": resolved.repo_id, "revision": resolved.revision}
    if composed_sources(resolved.path):  # --transformer / --vae: where those components came from
        provenance["components"] = composed_sources(resolved.path)
    return convert(resolved.path, out, dtype=dtype, layout=layout, mesh=mesh, sharding_rule=sharding_rule,
                   force=force, provenance=provenance, progress=progress, user_out=user_out, lora=lora,
                   quantize=quantize)


def convert_component(
    name: str,
    src: Path,
    dst: Path,
    dtype: Any,
    mesh: Mesh,
    sharding_rule: ShardingRule,
    group_bytes: int,
    progress: Callable[[str, int, int], None] | None,
    *,
    layout: str = DEFAULT_LAYOUT,
    deltas: Deltas | None = None,
    quantize: str | None = None,
) -> dict[str, Any]:
    """One component folder of a snapshot -> `dst/config.json` (and its other JSON) plus `dst/<layout>`,
    every parameter in `dtype` and JAX layout; returns its manifest entry. Peak memory over the
    baseline: about 64 MiB for flat (written in pieces through one buffer), about twice the
    largest parameter or group for Orbax (which stages a host copy of what it writes)."""
    dst.mkdir(parents=True)
    for path in sorted(src.glob("*.json")):
        if not path.name.endswith(".safetensors.index.json"):
            shutil.copyfile(path, dst / path.name)
    config = read_config(src)
    model = abstract_component(name, config, dtype)
    checkpoint = open_weights(src)
    if deltas is not None and isinstance(checkpoint, QuantizedCheckpoint):
        checkpoint.deltas = deltas  # a kept linear a LoRA changes is merged, then rounded to its form again
    # A quantized file's kept linears are written in their stored form (prequantized.py).
    model, plan, forms = prepare(model, components()[name].plan_for(model), checkpoint)
    _, abstract_state = nnx.split(model)
    flat = [(path, var.get_value()) for path, var in nnx.to_flat_state(abstract_state)]
    total = _stored_bytes(model, quantize)
    report = (lambda done: progress(name, done, total)) if progress else None
    if layout == "flat":
        from flux2klein_cli.core.weights.flat_index import FLAT_DIR
        from flux2klein_cli.core.weights.flat_store import write_flat

        check_plan(checkpoint, plan, dict(flat))
        if deltas is not None:
            deltas.check(weight_shapes(checkpoint, plan))
        writers: list[Any] = []
        for path, spec in flat:
            key, source = param_key(path), plan.sources[path]
            if _quantized(model, quantize, path):
                writers += quantized_writers(key, source, tuple(spec.shape), checkpoint, deltas)
            else:
                writers.append((key, tuple(spec.shape), np.dtype(spec.dtype),
                                lambda out, index, source=source: read_into(out, checkpoint, source, index, deltas)))
        write_flat(dst / FLAT_DIR, writers, progress=report)
    else:
        from flux2klein_cli.core.weights.orbax_store import ORBAX_DIR, write_orbax

        arrays = iter_arrays(checkpoint, plan, abstract_state, mesh, sharding_rule, deltas)
        write_orbax(dst / ORBAX_DIR, ((param_key(path), array) for path, array in arrays), group_bytes, report)
    return {
        "layout": layout,
        "checkpoint": f"{name}/{layout}",
        "parameters": sum(int(np.prod(spec.shape)) for _, spec in flat),
        "bytes": total,
        "config": config,
        **({"quantize": quantize, "quantized_linears": len(quantized_linear_paths(model))} if quantize else {}),
        **({"prequantized": {".".join(path): form for path, form in sorted(forms.items())},
            "source_format": checkpoint.file_format, "source_types": checkpoint.kinds()}
           if isinstance(checkpoint, QuantizedCheckpoint) else {}),
    }


def _manifest(source: Path, dtype: str, layout: str, mesh: Mesh, components: dict[str, Any],
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
        "layout": layout,
        # The sharding Orbax chunks were laid out for; a flat file serves any.
        **({"mesh": {str(k): int(v) for k, v in mesh.shape.items()}} if layout == "orbax" else {}),
        "pipeline_class": index.get("_class_name"),
        "source": {"path": str(source), **(provenance or {}), "files": files},
        "components": components,
        "copied": [rel for rel, _ in snapshot_files(source) if rel.split("/")[0] in COPIED_COMPONENTS]
        + ["model_index.json"],
    }


def needed_bytes(source: Path, dtype: str, quantize: str | None = None) -> int:
    """About what the converted directory takes: every parameter in `dtype` (int8 and scales where
    quantized), plus the copied files."""
    total = sum(size for rel, size in snapshot_files(source)
                if rel.split("/")[0] in COPIED_COMPONENTS or rel == "model_index.json")
    for name in MODEL_COMPONENTS:
        model = abstract_component(name, read_config(source / name), jax_dtype(dtype))
        total += _stored_bytes(model, quantize if name in QUANTIZED_COMPONENTS else None)
    return total


def _stored_bytes(model: nnx.Module, quantize: str | None) -> int:
    """Bytes of an abstract model's parameters as stored: a quantized kernel (..., in, out) as int8
    plus its float32 scales (..., out)."""
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        shape, dtype = tuple(var.get_value().shape), np.dtype(var.get_value().dtype)
        if _quantized(model, quantize, path) and str(path[-1]) == "embedding":
            total += int(np.prod(shape)) + shape[0] * np.dtype(SCALE_DTYPE).itemsize
        elif _quantized(model, quantize, path):
            total += int(np.prod(shape)) + int(np.prod((*shape[:-2], shape[-1]))) * np.dtype(SCALE_DTYPE).itemsize
        else:
            total += int(np.prod(shape)) * dtype.itemsize
    return total


def _quantized(model: nnx.Module, quantize: str | None, path: tuple[Any, ...]) -> bool:
    """Whether parameter `path` of the (unquantized) abstract model is stored as int8."""
    if not quantize:
        return False
    module, leaf = tuple(str(p) for p in path[:-1]), str(path[-1])
    return (leaf == "kernel" and module in set(quantized_linear_paths(model))) or \
        (leaf == "embedding" and module in set(quantized_embed_paths(model)))


def check_quantize(quantize: str | None, layout: str) -> str | None:
    """`--quantize`: None / "none" for none, else a known scheme in the flat layout."""
    if quantize in (None, "none"):
        return None
    check_quantize_name(quantize)
    if layout != "flat":
        raise FieldError("quantize", f"{quantize} needs {{field:layout}} flat (quantized Orbax checkpoints are not "
                         "written)")
    return quantize


def _replace(tmp: Path, out: Path) -> None:
    """Rename the finished directory into place; an existing one (--force, checked again now: it
    must still be only what convert wrote) is moved aside first and removed once the new one is there."""
    if not out.exists():
        tmp.rename(out)
        return
    check_replaceable(out)
    old = out.parent / f".{stem(out.name)}.replaced-{uuid.uuid4().hex[:8]}"
    out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)
