"""Loading the three models of a local FLUX.2 [klein] snapshot (core/hub/layout.py reads its layout)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from flux2klein_cli.core.errors import UserInputError
from flux2klein_cli.core.hub.layout import Snapshot


@dataclass
class LoadedModels:
    transformer: Any
    text_encoder: Any
    vae: Any
    seconds: dict[str, float] = field(default_factory=dict)


def parameter_stats(module: nnx.Module) -> tuple[int, int]:
    """(parameter count, bytes) of every array in a module's state."""
    leaves = jax.tree.leaves(nnx.state(module))
    return sum(int(np.prod(a.shape)) for a in leaves), sum(a.nbytes for a in leaves)


def stored_weights(component: Path) -> dict[str, Any] | None:
    """What a component's quantized file holds (`inspect`): its format, file and tensor types; None for
    safetensors weights in a float dtype."""
    from flux2klein_cli.core.weights.checkpoints import open_weights, quantized_file

    file = quantized_file(component)
    if file is None:
        return None
    checkpoint = open_weights(file)
    return {"format": checkpoint.file_format, "file": str(file), "types": checkpoint.kinds()}


def non_finite_parameters(module: nnx.Module) -> dict[str, int]:
    """Parameter path -> count of NaN / inf values, for the parameters that hold any. Checked
    on the host one array at a time (a compiled check would compile a program per shape)."""
    out = {}
    for path, variable in nnx.to_flat_state(nnx.state(module)):
        values = np.asarray(variable.get_value())
        if np.issubdtype(values.dtype, np.integer):
            continue
        bad = int(np.count_nonzero(~np.isfinite(values)))
        if bad:
            out[".".join(str(part) for part in path)] = bad
    return out


def load_models(
    snapshot: Snapshot,
    *,
    dtype: Any = jnp.bfloat16,
    mesh: Mesh | None = None,
    on_loaded: Callable[[str, float], None] | None = None,
    lora: Any = None,
) -> LoadedModels:
    """Load transformer, text encoder and VAE, each straight into `dtype` on the mesh: from the
    safetensors of a diffusers snapshot, or from a converted directory (flat or Orbax layout).
    `lora` (core/lora/merge.py LoraDeltas) is merged into the transformer's weights as they load,
    and into the text encoder's when a file has text-encoder keys."""
    from flux2klein_cli.core.models.qwen3 import load_qwen3
    from flux2klein_cli.core.models.transformer import load_transformer
    from flux2klein_cli.core.models.vae import load_vae

    loaders: dict[str, Callable[..., Any]] = {
        "transformer": load_transformer, "text_encoder": load_qwen3, "vae": load_vae
    }
    if lora is not None:
        if snapshot.converted:
            raise UserInputError(f"{snapshot.root}: {{field:lora}} needs a diffusers snapshot; a converted model's "
                                 "weights are final (merge LoRAs when converting: flux2klein convert --lora)")
        from functools import partial

        loaders["transformer"] = partial(load_transformer, deltas=lora)
        loaders["text_encoder"] = partial(load_qwen3, deltas=lora.for_component("text_encoder"))
    if snapshot.converted:
        from functools import partial

        from flux2klein_cli.core.weights.converted import load_component

        loaders = {name: partial(_load_converted, load_component, name, snapshot.root) for name in loaders}
    loaded: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for name, load in loaders.items():
        start = time.perf_counter()
        module = load(snapshot.component(name), dtype=dtype, mesh=mesh)
        jax.block_until_ready(nnx.state(module))
        seconds[name] = time.perf_counter() - start
        loaded[name] = module
        if on_loaded:
            on_loaded(name, seconds[name])
    return LoadedModels(**loaded, seconds=seconds)


def _load_converted(load_component: Callable[..., Any], name: str, root: Path, _component_dir: Path, *,
                    dtype: Any, mesh: Mesh | None) -> Any:
    from flux2klein_cli.core.devices.sharding import model_rule, replicated_rule

    # The same parameter rules as the safetensors path (the VAE stays replicated).
    rule = replicated_rule if name == "vae" else model_rule(mesh)
    return load_component(name, root, dtype=dtype, mesh=mesh, sharding_rule=rule)
