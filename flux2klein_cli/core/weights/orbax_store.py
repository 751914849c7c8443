"""Converted directories: their format, and loading them (see orbax_convert.py for writing them).

Layout of a directory written by `flux2klein convert` (the directory alone is a complete `--model`):

    flux2klein-manifest.json   written last: source, revision, file sizes / hashes, dtype, configs
    model_index.json           copied
    transformer/config.json    copied (every JSON of the component but the weight index)
    transformer/orbax/         one Orbax PyTree checkpoint: NNX parameter path -> array
    text_encoder/..., vae/...  the same
    tokenizer/, scheduler/     copied as they are

Parameters are stored in JAX layout (linear kernels already transposed, stacked layers
stacked) and in the target dtype, so loading reads each device's slice of each array straight
into place: nothing is converted or transposed at load time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.mesh import default_mesh
from flux2klein_cli.core.snapshot import CONVERTED_MANIFEST
from flux2klein_cli.core.weights.configs import read_config, read_json
from flux2klein_cli.core.weights.loader import KeyPlan, ShardingRule, _replicate, aligned_empty, raise_on_mismatch

FORMAT = "flux2klein-orbax"
FORMAT_VERSION = 1
MODEL_COMPONENTS = ("transformer", "text_encoder", "vae")
COPIED_COMPONENTS = ("tokenizer", "scheduler")
ORBAX_DIR = "orbax"
DTYPE_NAMES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
_READ_BUDGET = 512 << 20  # bytes being read at once when restoring (or one array, if larger)


# ----------------------------------------------------------------------------- components


@dataclass(frozen=True)
class Component:
    """How to build one model abstractly from its config, and where its weights come from."""

    build: Callable[[dict[str, Any], Any], nnx.Module]
    plan_for: Callable[[Any], KeyPlan]


def components() -> dict[str, Component]:
    from flux2klein_cli.core.models.qwen3 import Qwen3Config, Qwen3TextEncoder, qwen3_key_plan
    from flux2klein_cli.core.models.transformer import Flux2Transformer, TransformerConfig, transformer_key_plan
    from flux2klein_cli.core.models.vae import VAEConfig, build_vae, vae_key_plan

    return {
        "transformer": Component(
            lambda c, d: Flux2Transformer(TransformerConfig.from_dict(c), dtype=d, rngs=nnx.Rngs(0)),
            transformer_key_plan,
        ),
        "text_encoder": Component(
            lambda c, d: Qwen3TextEncoder(Qwen3Config.from_dict(c), dtype=d, rngs=nnx.Rngs(0)), qwen3_key_plan
        ),
        "vae": Component(lambda c, d: build_vae(VAEConfig.from_dict(c), dtype=d), vae_key_plan),
    }


def abstract_component(name: str, config: dict[str, Any], dtype: Any) -> nnx.Module:
    component = components()[name]
    return nnx.eval_shape(lambda: component.build(config, dtype))


def orbax_key(path: tuple[Any, ...]) -> str:
    """One flat, readable name per NNX parameter path, e.g. `encoder.down_blocks.0.resnets.1.conv1.kernel`."""
    return ".".join(str(p) for p in path)


_CHUNK_BYTES = 128 << 20


def _storage_options(ocp: Any) -> Callable[[Any, Any], Any]:
    """Per-array chunking: a stacked parameter (leading layer axis) is chunked by layers, so every
    chunk is one contiguous slab of the array and a read is a straight copy; anything else gets
    chunks of at most 128 MiB (row bands for a big embedding). Many chunks let TensorStore read
    in parallel, and a device that owns a shard reads little more than its shard."""
    storage = ocp.options.ArrayOptions.Saving.StorageOptions

    def options(_keypath: Any, value: Any) -> Any:
        if getattr(value, "ndim", 0) >= 3 and value.nbytes > _CHUNK_BYTES:
            return storage(shard_axes=(0,))
        return storage(chunk_byte_size=_CHUNK_BYTES)

    return options


@contextmanager
def orbax_context() -> Iterator[Any]:
    """Orbax's v1 API with our storage options: uncompressed (weights barely compress, and zstd
    would cost more time at load than it saves in reading) and chunked as above."""
    import orbax.checkpoint.experimental.v1 as ocp

    context = ocp.Context()
    context.array.saving.use_compression = False
    context.array.saving.scoped_storage_options_creator = _storage_options(ocp)
    with context:
        yield ocp


# ----------------------------------------------------------------------------- reading


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of a converted directory, checked for format and completeness."""
    root = Path(root)
    manifest = read_json(root / CONVERTED_MANIFEST)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{root / CONVERTED_MANIFEST}: not a flux2klein convert manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{root}: converted with format version {manifest.get('format_version')}, this flux2klein reads "
            f"version {FORMAT_VERSION}; convert the source snapshot again"
        )
    return manifest


def check_converted(root: str | Path) -> dict[str, Any]:
    """Raise a CheckpointError unless `root` is a complete converted directory; return its manifest."""
    root = Path(root)
    manifest = read_manifest(root)
    missing = [f"{name}/config.json" for name in MODEL_COMPONENTS if not (root / name / "config.json").is_file()]
    missing += [f"{name}/{ORBAX_DIR}" for name in MODEL_COMPONENTS if not _is_orbax_checkpoint(root / name / ORBAX_DIR)]
    missing += [f"{name}/" for name in COPIED_COMPONENTS if not (root / name).is_dir()]
    if not (root / "model_index.json").is_file():
        missing.append("model_index.json")
    if missing:
        raise CheckpointError(f"{root}: incomplete converted directory, missing {', '.join(missing)}")
    return manifest


def _is_orbax_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "_CHECKPOINT_METADATA").is_file()


def load_component(
    name: str,
    root: str | Path,
    *,
    dtype: Any = jnp.bfloat16,
    mesh: Mesh | None = None,
    sharding_rule: ShardingRule = _replicate,
) -> nnx.Module:
    """Restore one component of a converted directory straight into `dtype` and its shardings.

    The abstract model gives every parameter's shape; its sharding comes from `mesh` and
    `sharding_rule`; each device's slice is read from the checkpoint into its own buffer (and
    cast on the way if `dtype` differs from the stored one). No other host copy is made."""
    root = Path(root)
    mesh = mesh or default_mesh()
    model = abstract_component(name, read_config(root / name), dtype)
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    targets = {}
    for path, var in flat:
        spec = var.get_value()
        sharding = NamedSharding(mesh, sharding_rule(tuple(path), tuple(spec.shape)))
        targets[orbax_key(path)] = jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)
    restored = restore_arrays(root / name / ORBAX_DIR, targets)
    return nnx.merge(graphdef, nnx.from_flat_state([(path, var.replace(restored[orbax_key(path)]))
                                                    for path, var in flat]))


def restore_arrays(checkpoint: Path, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """Read an Orbax PyTree checkpoint's arrays into `targets` (shape, dtype, sharding).

    The arrays are opened with the TensorStore specs Orbax itself reads them with, then each
    addressable shard is written by TensorStore straight into an aligned host buffer that the
    device adopts (on CPU without a copy; on an accelerator the buffer is transferred and freed).
    `ocp.load` does the same but reads into a buffer of its own and then copies it, which on
    this project's CPU hosts made it 1.6-2x slower and peak at 1.4x the model instead of 1.03x.
    At most `_READ_BUDGET` bytes (or one array, if larger) are in flight."""
    import tensorstore as ts
    from etils import epath
    from orbax.checkpoint import type_handlers

    stored = _stored_arrays(checkpoint)
    _check_keys(checkpoint, stored, targets)
    state = checkpoint / "state"  # the PyTree checkpointable that `ocp.partial.save` writes
    context = type_handlers.get_ts_context(use_ocdbt=True)
    opened = {}
    for key in targets:
        info = type_handlers.ParamInfo(name=key, parent_dir=epath.Path(state), use_zarr3=True, ts_context=context)
        opened[key] = ts.open(type_handlers.get_json_tspec_read(info, use_ocdbt=True), open=True, context=context)

    results: dict[str, jax.Array] = {}
    in_flight: list[tuple[int, Callable[[], None]]] = []
    budget = 0

    def drain(limit: int) -> None:
        nonlocal budget
        while in_flight and budget > limit:
            size, finish = in_flight.pop(0)
            finish()
            budget -= size

    for key, target in targets.items():
        try:
            store = opened[key].result()
        except ValueError as e:
            raise CheckpointError(f"{checkpoint}: cannot open {key} ({str(e).splitlines()[0]})") from None
        if store.dtype.numpy_dtype != np.dtype(target.dtype):
            store = ts.cast(store, ts.dtype(np.dtype(target.dtype).name))
        # Devices holding the same slice (replication) share one read.
        by_index: dict[tuple[tuple[int, int], ...], list[tuple[jax.Device, tuple[slice, ...]]]] = {}
        for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
            bounds = tuple(s.indices(n)[:2] for s, n in zip(index, target.shape, strict=True))
            by_index.setdefault(bounds, []).append((device, index))
        pieces: list[tuple[jax.Device, np.ndarray, Any]] = []
        for group in by_index.values():
            index = group[0][1]
            shard_shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, target.shape, strict=True))
            buffer = aligned_empty(shard_shape, np.dtype(target.dtype))
            write = ts.array(buffer).write(store[index] if index else store)
            pieces.extend((device, buffer, write) for device, _ in group)

        def finish(key: str = key, target: jax.ShapeDtypeStruct = target, pieces: list = pieces) -> None:
            arrays = []
            for device, buffer, write in pieces:
                try:
                    write.result()
                except ValueError as e:
                    raise CheckpointError(f"{checkpoint}: cannot read {key} ({str(e).splitlines()[0]})") from None
                arrays.append(jax.device_put(buffer, device))
            results[key] = jax.make_array_from_single_device_arrays(target.shape, target.sharding, arrays)

        size = int(np.prod(target.shape)) * np.dtype(target.dtype).itemsize
        in_flight.append((size, finish))
        budget += size
        drain(_READ_BUDGET)
    drain(-1)
    return results


def _stored_arrays(checkpoint: Path) -> dict[str, Any]:
    """Name -> metadata (shape, dtype) of every array in a checkpoint, from Orbax's own metadata."""
    with orbax_context() as ocp:
        try:
            stored = ocp.metadata(checkpoint).metadata
        except (OSError, ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"{checkpoint}: unreadable Orbax checkpoint ({str(e).splitlines()[0]})") from None
    if not isinstance(stored, dict):
        raise CheckpointError(f"{checkpoint}: unexpected checkpoint structure")
    return stored


def _check_keys(where: Path, stored: Any, targets: dict[str, jax.ShapeDtypeStruct]) -> None:
    """The same strictness and message as the safetensors loader: missing, unexpected, reshaped."""
    raise_on_mismatch(
        where,
        missing=set(targets) - set(stored),
        unexpected=set(stored) - set(targets),
        wrong=[f"{k} is {tuple(stored[k].shape)}, model expects {tuple(targets[k].shape)}"
               for k in sorted(set(stored) & set(targets)) if tuple(stored[k].shape) != tuple(targets[k].shape)],
    )
