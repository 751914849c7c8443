"""Logical axis rules: which mesh axes shard each parameter and activation.

One mesh, axes (data, fsdp, tensor, context) (core/devices/mesh.py). The rules:

- parameters: FSDP shards every matrix of the transformer and the text encoder over
  `fsdp`; `tensor` shards attention heads and MLP width (the output features of q / k / v
  and MLP-in projections, the input features of the output projections, Megatron style);
  scanned blocks keep their leading layer axis whole; token embeddings split over their
  features. Norm scales, biases and the VAE (small, convolutional) are replicated. A
  dimension a mesh axis does not divide stays whole.
- activations: the batch over (data, fsdp), the image-token sequence over `context`,
  heads over `tensor`; keys and values are gathered over `context` for attention.
  A batch (classifier-free guidance's pair counted) that (data, fsdp) does not divide is
  split over the largest part of them that does, and the rest of those axes hold copies
  of it (`fitting_axes`): batch 1 on fsdp=8 runs whole on every device, with the weights
  still split as above. Any batch runs on any mesh. The axes a batch leaves idle either hold
  copies of it or split its image tokens as `context` does (`token_axes`: queries split,
  keys and values gathered); `IDLE_FORMS` names the forms, the trace options pick one.

The same rules drive loading (each host reads only its devices' slices), conversion,
ahead-of-time compilation and running. Under jit, GSPMD inserts the collectives; a
sharding only decides where work and bytes live, never the result.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from flux2klein_cli.core import settings

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


Axes = str | tuple[str, ...] | None


def fitting_axes(mesh: Mesh, dim: int, axes: Axes) -> Axes:
    """The axes that split a dimension of size `dim`: `axes` when they divide it, else the
    largest part of them that does (ties: the first in axis order), else None (whole).
    Every sharding of a batch goes through here, so inputs, constraints, shard_maps and
    stored executables agree on where each image lives."""
    if axes is None or isinstance(axes, str):
        return axes if axes is not None and dim % axis_size(mesh, axes) == 0 else None
    best: tuple[str, ...] | None = None
    for k in range(len(axes), 0, -1):
        for subset in itertools.combinations(axes, k):
            size = axis_size(mesh, subset)
            if dim % size == 0 and size > axis_size(mesh, best):
                best = subset
    if best is None:
        return None
    return best[0] if len(best) == 1 else best


def fitting_spec(mesh: Mesh, shape: tuple[int, ...], axes: tuple[Axes, ...] | list[Axes]) -> PartitionSpec:
    """A PartitionSpec of `axes` per dimension, each cut to what divides its dimension."""
    return PartitionSpec(*[fitting_axes(mesh, shape[i], a) for i, a in enumerate(axes)])


def _fits(mesh: Mesh, spec: list[str | None], shape: tuple[int, ...]) -> PartitionSpec:
    """Drop any axis that does not divide its dimension."""
    return fitting_spec(mesh, shape, spec)


def parameter_spec(mesh: Mesh, path: tuple[str, ...], shape: tuple[int, ...]) -> PartitionSpec:
    """The PartitionSpec of one transformer or text-encoder parameter."""
    names = [str(p) for p in path]
    # The module is the last name that is not a list index (`to_out.0.kernel` is to_out's).
    leaf, module = names[-1], next((n for n in reversed(names[:-1]) if not n.isdigit()), "")
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
    elif leaf == "scale" and len(shape) - first == 1 and module in COLUMN | ROW:
        spec[-1] = "tensor" if module in COLUMN else "fsdp"  # an int8 kernel's scales: split as its outputs
    return _fits(mesh, spec, shape)


def parameter_rule(mesh: Mesh) -> Rule:
    return lambda path, shape: parameter_spec(mesh, path, shape)


def replicated_rule(path: tuple[str, ...], shape: tuple[int, ...]) -> PartitionSpec:
    return PartitionSpec()


def model_rule(mesh: Mesh | None) -> Rule:
    """The parameter rule of the transformer and text encoder: replicated without a mesh."""
    return replicated_rule if mesh is None else parameter_rule(mesh)


def batch_spec(mesh: Mesh, batch: int, rank: int) -> PartitionSpec:
    """Leading batch dimension over what of (data, fsdp) divides it, the rest whole."""
    return PartitionSpec(fitting_axes(mesh, batch, BATCH_AXES), *([None] * (rank - 1)))


def batch_shards(batch: int) -> int:
    """Over how many devices a batch of `batch` is split under the mesh set with
    `jax.set_mesh` (as `batch_spec` splits it); 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return axis_size(mesh, fitting_axes(mesh, batch, BATCH_AXES))


# What the batch axes a batch leaves idle do: "sequence" splits the image-token sequence over
# them (as `context`), "replicate" holds copies of the batch; "auto" is the rule of
# `idle_form` (docs/multi-device.md has the measurements behind it).
IDLE_FORMS = settings.IDLE_AXES_CHOICES  # FLUX2KLEIN_IDLE_AXES forces one


def idle_batch_axes(mesh: Mesh | jax.sharding.AbstractMesh, batch: int) -> tuple[str, ...]:
    """The batch axes (of size > 1) that a batch of `batch` is not split over."""
    used = fitting_axes(mesh, batch, BATCH_AXES)
    used = () if used is None else (used,) if isinstance(used, str) else used
    return tuple(a for a in BATCH_AXES if a not in used and mesh.shape.get(a, 1) > 1)


def idle_form(mesh: Mesh | jax.sharding.AbstractMesh, batch: int, form: str = "auto") -> str:
    """The form the idle batch axes take for a batch of `batch`: `form` unless "auto". Auto
    splits the tokens at every shape: of the shapes measured (9B on v6e-4 at batch 1 and 2 by
    XLA's analysis, 8 virtual CPU devices by wall time; docs/benchmarks.md) none favoured copies."""
    if form not in IDLE_FORMS:
        raise ValueError(f"idle-axes form {form!r} is not one of {IDLE_FORMS}")
    return form if form != "auto" else "sequence"


def token_axes(batch: int, form: str = "auto") -> Axes:
    """The axes that split the image-token sequence of a batch of `batch` under the mesh set
    with `jax.set_mesh`: `context`, and in the sequence form also the batch axes the batch
    leaves idle. The batch itself stays on `fitting_axes`, so no axis is used twice."""
    mesh = jax.sharding.get_abstract_mesh()
    idle = () if mesh.empty or idle_form(mesh, batch, form) != "sequence" else idle_batch_axes(mesh, batch)
    return ("context", *idle) if idle else "context"


def constrain(x: jax.Array, *axes: Axes) -> jax.Array:
    """with_sharding_constraint by axis names under the mesh set with `jax.set_mesh`; a no-op
    without one (single device); axes cut to what divides their dimension (`fitting_axes`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, fitting_spec(mesh, x.shape, axes))
