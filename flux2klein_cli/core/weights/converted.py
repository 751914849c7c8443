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
that is only ever read one way, so a directory holds one layout, named in the manifest, which
converted_manifest.py reads and checks without jax.
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

from flux2klein_cli.core.devices.mesh import default_mesh
from flux2klein_cli.core.devices.sharding import replicated_rule
from flux2klein_cli.core.hub.snapshot import CONVERTED_MANIFEST
from flux2klein_cli.core.weights.configs import read_config
from flux2klein_cli.core.weights.converted_manifest import (
    component_layout,
    prequantized_forms,
    quantize_scheme,
    read_manifest,
)
from flux2klein_cli.core.weights.loader import KeyPlan, ShardingRule


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
        from flux2klein_cli.core.weights.flat_index import FLAT_DIR
        from flux2klein_cli.core.weights.flat_store import load_arrays

        restored = load_arrays(root / name / FLAT_DIR, targets)
    else:
        from flux2klein_cli.core.weights.orbax_store import ORBAX_DIR, restore_arrays

        restored = restore_arrays(root / name / ORBAX_DIR, targets)
    return nnx.merge(graphdef, nnx.from_flat_state([(path, var.replace(restored[param_key(path)]))
                                                    for path, var in flat]))
