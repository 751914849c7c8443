"""Logical axis rules: which mesh axes shard each parameter and activation.

One mesh, axes (data, fsdp, tensor, context) (core/mesh.py). The rules:

- parameters: FSDP shards every matrix of the transformer and the text encoder over
  `fsdp`; `tensor` shards attention heads and MLP width (the output features of q / k / v
  and MLP-in projections, the input features of the output projections, Megatron style);
  scanned blocks keep their leading layer axis whole; token embeddings split over their
  features. Norm scales, biases and the VAE (small, convolutional) are replicated. A
  dimension a mesh axis does not divide stays whole.
- activations: the batch over (data, fsdp), the image-token sequence over `context`,
  heads over `tensor`; keys and values are gathered over `context` for attention.

The same rules drive loading (each host reads only its devices' slices), conversion,
ahead-of-time compilation and running. Under jit, GSPMD inserts the collectives; a
sharding only decides where work and bytes live, never the result.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

BATCH_AXES = ("data", "fsdp")
# Projections whose output features are heads or MLP width (column parallel) ...
COLUMN = {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "linear_in", "to_qkv_mlp_proj",
          "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
# ... and those that bring them back to the model width (row parallel).
ROW = {"to_out", "to_add_out", "linear_out", "o_proj", "down_proj"}
STACKED = {"transformer_blocks", "single_transformer_blocks", "layers"}

Rule = Callable[[tuple[str, ...], tuple[int, ...]], PartitionSpec]


def axis_size(mesh: Mesh, axes: str | tuple[str, ...] | None) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape.get(name, 1) for name in names]))


def _fits(mesh: Mesh, spec: list[str | None], shape: tuple[int, ...]) -> PartitionSpec:
    """Drop any axis that does not divide its dimension."""
    return PartitionSpec(*[a if a and shape[i] % axis_size(mesh, a) == 0 else None for i, a in enumerate(spec)])


def parameter_spec(mesh: Mesh, path: tuple[str, ...], shape: tuple[int, ...]) -> PartitionSpec:
    """The PartitionSpec of one transformer or text-encoder parameter."""
    names = [str(p) for p in path]
    leaf, module = names[-1], names[-2] if len(names) > 1 else ""
    first = 1 if names[0] in STACKED else 0  # the scan's layer axis stays whole
    spec: list[str | None] = [None] * len(shape)
    if leaf == "embedding" and len(shape) == 2:
        # A token table split over its features: every chip looks up every token in its own
        # slice, a local gather. Split over the vocabulary, the lookup becomes a masked gather
        # and a reduction that libtpu compiles about 1 s slower for Qwen3-8B (and runs no faster).
        spec[-1] = "fsdp"
    elif leaf == "kernel" and len(shape) - first >= 2:
        if module in COLUMN:
            spec[-2:] = ["fsdp", "tensor"]
        elif module in ROW:
            spec[-2:] = ["tensor", "fsdp"]
        else:  # embedders, modulation, output layers: FSDP over the largest dimension
            largest = max(range(first, len(shape)), key=lambda i: shape[i])
            spec[largest] = "fsdp"
    return _fits(mesh, spec, shape)


def parameter_rule(mesh: Mesh) -> Rule:
    return lambda path, shape: parameter_spec(mesh, path, shape)


def replicated_rule(path: tuple[str, ...], shape: tuple[int, ...]) -> PartitionSpec:
    return PartitionSpec()


def model_rule(mesh: Mesh | None) -> Rule:
    """The parameter rule of the transformer and text encoder: replicated without a mesh."""
    return replicated_rule if mesh is None else parameter_rule(mesh)


def batch_spec(mesh: Mesh, batch: int, rank: int) -> PartitionSpec:
    """Leading batch dimension over (data, fsdp) when they divide it, the rest whole."""
    axes = BATCH_AXES if batch % axis_size(mesh, BATCH_AXES) == 0 else None
    return PartitionSpec(axes, *([None] * (rank - 1)))


def batch_shards(batch: int) -> int:
    """Over how many devices a batch of `batch` is split under the mesh set with
    `jax.set_mesh` (as `batch_spec` splits it); 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    shards = axis_size(mesh, BATCH_AXES)
    return shards if batch % shards == 0 else 1


def constrain(x: jax.Array, *axes: str | tuple[str, ...] | None) -> jax.Array:
    """with_sharding_constraint by axis names under the mesh set with `jax.set_mesh`; a no-op
    without one (single device) and for axes that do not divide their dimension."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    spec = [a if a is not None and x.shape[i] % axis_size(mesh, a) == 0 else None for i, a in enumerate(axes)]
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))
