"""Converted directories: their format, checking them, and loading their components.

A directory written by `flux2klein convert` (convert.py) is a complete `--model`:

    flux2klein-manifest.json   written last: source, revision, file sizes / hashes, dtype, layout, configs
    model_index.json           copied
    transformer/config.json    copied (every JSON of the component but the weight index)
    transformer/flat/          the parameters in the flat layout (flat_store.py), or
    transformer/orbax/         one Orbax PyTree checkpoint (orbax_store.py), as `convert --layout` chose
    text_encoder/..., vae/...  the same
    tokenizer/, scheduler/     copied as they are

Both layouts hold the parameters in their target dtype and JAX layout (linear kernels already
transposed, scanned layers stacked), contiguous and page-aligned in files, so nothing is
converted or transposed at load time: the files are mapped, and on a CPU host the arrays are
views of the page cache adopted by JAX without a copy (mapped.py). A load costs what touching
the pages costs (the 4B transformer's 7.75 GB: about 0.5 s with every page touched, under half
the time `cat` takes to read them, where a copying loader needs 20 s or more on this project's
VMs; docs/benchmarks.md). With a sharding, each device's slice is cut from the mapping and
placed with `device_put`, so a device reads only its shard. They differ in how they are written
and who else reads them, and `convert --layout` picks one per directory:

- **flat** (the default): one file per component, written in pieces of at most 64 MiB through
  one buffer (converting the 4B transformer peaks at 0.55 GB), with a checked header and a
  CRC-32 per parameter (`flat_store.verify`).
- **orbax**: an Orbax PyTree checkpoint of plain zarr (v2) arrays, uncompressed, one chunk file
  per shard it was written with (orbax_store.py). Orbax, TensorStore and zarr readers open it as
  it is. Orbax stages a host copy of what it writes, so converting peaks at about twice the
  largest parameter (7.7 GB for the 4B transformer). Orbax checkpoints in other forms (OCDBT,
  compressed) also load, through TensorStore, with a copy.

Writing both would double the disk (18 GB more for 9B) and the conversion time for a directory
that is only ever read one way, so a directory holds one layout, named in the manifest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from flux2klein_cli.core.choices import LAYOUTS
from flux2klein_cli.core.devices.mesh import default_mesh
from flux2klein_cli.core.devices.sharding import replicated_rule
from flux2klein_cli.core.errors import CheckpointError
from flux2klein_cli.core.hub.snapshot import CONVERTED_MANIFEST
from flux2klein_cli.core.weights.configs import read_config, read_json
from flux2klein_cli.core.weights.loader import KeyPlan, ShardingRule

FORMAT = "flux2klein-converted"
# Stored arrays are named by the models' parameter paths (`param_key`), so a change of a model's
# tree is a new version. 3: the transformer's tree mirrors diffusers' (`to_out.0`,
# `time_guidance_embed`, `*.linear`). Older directories (2, and 1 under the format name
# "flux2klein-orbax") are refused with a message to convert again.
FORMAT_VERSION = 3
_KNOWN_FORMATS = (FORMAT, "flux2klein-orbax")
MODEL_COMPONENTS = ("transformer", "text_encoder", "vae")
COPIED_COMPONENTS = ("tokenizer", "scheduler")


@dataclass(frozen=True)
class Component:
    """How to build one model abstractly (shapes only) from its config, and where its weights come from."""

    build: Callable[[dict[str, Any], Any], nnx.Module]
    plan_for: Callable[[Any], KeyPlan]


def components() -> dict[str, Component]:
    from flux2klein_cli.core.models.qwen3 import Qwen3Config, abstract_text_encoder, qwen3_key_plan
    from flux2klein_cli.core.models.transformer import TransformerConfig, abstract_transformer, transformer_key_plan
    from flux2klein_cli.core.models.vae import VAEConfig, abstract_vae, vae_key_plan

    return {
        "transformer": Component(
            lambda c, d: abstract_transformer(TransformerConfig.from_dict(c), dtype=d),
            transformer_key_plan,
        ),
        "text_encoder": Component(
            lambda c, d: abstract_text_encoder(Qwen3Config.from_dict(c), dtype=d), qwen3_key_plan
        ),
        "vae": Component(lambda c, d: abstract_vae(VAEConfig.from_dict(c), dtype=d), vae_key_plan),
    }


def abstract_component(name: str, config: dict[str, Any], dtype: Any) -> nnx.Module:
    component = components()[name]
    return component.build(config, dtype)


def param_key(path: tuple[Any, ...]) -> str:
    """One flat, readable name per NNX parameter path, e.g. `encoder.down_blocks.0.resnets.1.conv1.kernel`."""
    return ".".join(str(p) for p in path)


def quantize_scheme(manifest: dict[str, Any], name: str) -> str | None:
    """The quantization a component was written with (`convert --quantize`), None for none."""
    scheme = (manifest.get("components", {}).get(name) or {}).get("quantize")
    return None if scheme in (None, "none") else str(scheme)


def prequantized_forms(manifest: dict[str, Any], name: str) -> tuple[tuple[str, str], ...]:
    """The linears a component keeps in the form its quantized source file stored them in (convert of a
    GGUF / ComfyUI file: core/weights/prequantized.py), as sorted (dotted module path, form) pairs."""
    forms = (manifest.get("components", {}).get(name) or {}).get("prequantized") or {}
    return tuple(sorted((str(path), str(form)) for path, form in forms.items()))


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of a converted directory, checked for format and version."""
    root = Path(root)
    manifest = read_json(root / CONVERTED_MANIFEST)
    fmt, version = manifest.get("format"), manifest.get("format_version")
    if fmt not in _KNOWN_FORMATS:
        raise CheckpointError(f"{root / CONVERTED_MANIFEST}: not a flux2klein convert manifest")
    if (fmt, version) != (FORMAT, FORMAT_VERSION):
        raise CheckpointError(
            f"{root}: converted with format version {version}, this flux2klein reads version {FORMAT_VERSION}; "
            "convert the source snapshot again"
        )
    return manifest


def component_layout(manifest: dict[str, Any], name: str) -> str:
    """The layout a component was written in ("flat" or "orbax")."""
    entry = manifest.get("components", {}).get(name) or {}
    layout = entry.get("layout")
    if layout not in LAYOUTS:
        raise CheckpointError(f"manifest: component {name!r} has unknown layout {layout!r}")
    return layout


def check_converted(root: str | Path) -> dict[str, Any]:
    """Raise a CheckpointError unless `root` is a complete converted directory; return its manifest.
    Cheap: reads the manifest, and for flat components their index and data file header."""
    from flux2klein_cli.core.weights import flat_store

    root = Path(root)
    manifest = read_manifest(root)
    missing = [f"{name}/config.json" for name in MODEL_COMPONENTS if not (root / name / "config.json").is_file()]
    for name in MODEL_COMPONENTS:
        layout = component_layout(manifest, name)
        where = root / name / layout
        if layout == "orbax" and not (where / "_CHECKPOINT_METADATA").is_file():
            missing.append(f"{name}/orbax")
        elif layout == "flat" and not where.is_dir():
            missing.append(f"{name}/flat")
    missing += [f"{name}/" for name in COPIED_COMPONENTS if not (root / name).is_dir()]
    if not (root / "model_index.json").is_file():
        missing.append("model_index.json")
    if missing:
        raise CheckpointError(f"{root}: incomplete converted directory, missing {', '.join(missing)}")
    for name in MODEL_COMPONENTS:
        if component_layout(manifest, name) == "flat":
            flat_store.read_index(root / name / flat_store.FLAT_DIR)
    return manifest


def load_component(
    name: str,
    root: str | Path,
    *,
    dtype: Any = jnp.bfloat16,
    mesh: Mesh | None = None,
    sharding_rule: ShardingRule = replicated_rule,
    layout: str | None = None,
) -> nnx.Module:
    """One component of a converted directory, straight into `dtype` and its shardings.

    The abstract model gives every parameter's shape; its sharding comes from `mesh` and
    `sharding_rule`; each device's slice comes from the stored array (cast on the way if `dtype`
    differs from the stored one; int8 kernels and their scales stay as stored). `layout` is read
    from the manifest unless given (a directory written component by component, as bench_load
    does, has none)."""
    from flux2klein_cli.core.models.quantized import prequantize_abstract, quantize_abstract

    root = Path(root)
    manifest = read_manifest(root) if layout is None or (root / CONVERTED_MANIFEST).is_file() else {}
    layout = layout or component_layout(manifest, name)
    mesh = mesh or default_mesh()
    # A quantized component's int8 kernels and float32 scales keep their stored dtypes whatever `dtype`.
    model = quantize_abstract(abstract_component(name, read_config(root / name), dtype),
                              quantize_scheme(manifest, name))
    forms = {tuple(path.split(".")): form for path, form in prequantized_forms(manifest, name)}
    model = prequantize_abstract(model, forms)
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    targets = {}
    for path, var in flat:
        spec = var.get_value()
        sharding = NamedSharding(mesh, sharding_rule(tuple(path), tuple(spec.shape)))
        targets[param_key(path)] = jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)
    if layout == "flat":
        from flux2klein_cli.core.weights.flat_store import FLAT_DIR, load_arrays

        restored = load_arrays(root / name / FLAT_DIR, targets)
    else:
        from flux2klein_cli.core.weights.orbax_store import ORBAX_DIR, restore_arrays

        restored = restore_arrays(root / name / ORBAX_DIR, targets)
    return nnx.merge(graphdef, nnx.from_flat_state([(path, var.replace(restored[param_key(path)]))
                                                    for path, var in flat]))
