"""A transformer loaded from a file that arrives quantized (GGUF, ComfyUI fp8 / nvfp4), keeping quantized
what the model can hold quantized.

Which linears stay quantized (`kept_forms`, one rule for load, convert and compile): a linear of
the scanned blocks (core/models/quantized.py QUANTIZED_STACKS) whose weight is stored, in every
layer, in one form the model holds as it is (WEIGHT_FORMS: GGUF Q8_0, ComfyUI fp8). Its int8 /
fp8 values and scales are read as stored, never dequantized, so the model holds about a byte per
weight. Every other tensor (the K-quants, Q4_0, nvfp4, and the linears outside the blocks) is
dequantized to the model dtype as it loads, one tensor at a time: they are as large in memory as
a bf16 model's, as small as their file on disk.

With LoRAs, a kept linear that a LoRA changes is merged in float32 and rounded to its form
again (quantized_file.py), so the model's structure (and its stored executables) does not
depend on which LoRAs are loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from flax import nnx
from jax.sharding import Mesh

from flux2klein_cli.core.devices.sharding import replicated_rule
from flux2klein_cli.core.models.quantized import WEIGHT_FORMS, prequantize_abstract, quantized_linear_paths
from flux2klein_cli.core.weights.checkpoints import Checkpoint, open_weights, quantized_file
from flux2klein_cli.core.weights.loader import Deltas, KeyPlan, ShardingRule, TensorSource, load_from
from flux2klein_cli.core.weights.quantized_file import SCALES, VALUES, QuantizedCheckpoint

M = TypeVar("M", bound=nnx.Module)
Forms = dict[tuple[str, ...], str]


def kept_forms(checkpoint: Checkpoint, model: nnx.Module, plan: KeyPlan) -> Forms:
    """Module path -> WEIGHT_FORMS name of each linear held in its stored form (see the module docstring)."""
    if not isinstance(checkpoint, QuantizedCheckpoint):
        return {}
    forms: Forms = {}
    for path in quantized_linear_paths(model):
        source = plan.sources.get((*path, "kernel"))
        if source is None or any(key not in checkpoint.tensors for key in source.keys):
            continue  # the key check reports it
        names = {checkpoint.form(key) for key in source.keys}
        if len(names) == 1 and None not in names:
            forms[path] = names.pop()
    return forms


def kept_plan(plan: KeyPlan, forms: Mapping[tuple[str, ...], str]) -> KeyPlan:
    """`plan` with each kept linear's kernel read from its stored values and its scale from its stored
    scales; the float keys they replace, and the parts of every other key, are not read."""
    sources = dict(plan.sources)
    replaced: set[str] = set()
    for path, name in forms.items():
        kernel = sources[(*path, "kernel")]
        replaced |= set(kernel.keys)
        sources[(*path, "kernel")] = TensorSource(tuple(k + VALUES for k in kernel.keys), "linear", kernel.stacked)
        layout = "none" if WEIGHT_FORMS[name].block is None else "linear"
        sources[(*path, "scale")] = TensorSource(tuple(k + SCALES for k in kernel.keys), layout, kernel.stacked)
    ignore = plan.ignore
    return KeyPlan(sources, lambda key: ignore(key) or VALUES in key or SCALES in key or key in replaced)


def prepare(model: nnx.Module, plan: KeyPlan, checkpoint: Checkpoint) -> tuple[nnx.Module, KeyPlan, Forms]:
    """An abstract model and its plan made fit for `checkpoint`: kept linears swapped and re-planned."""
    if not isinstance(checkpoint, QuantizedCheckpoint):
        return model, plan, {}
    forms = kept_forms(checkpoint, model, plan)
    return prequantize_abstract(model, forms), kept_plan(plan, forms), forms


def load_module(
    build: Callable[[], M] | M,
    plan_for: Callable[[M], KeyPlan],
    directory: str | Path,
    mesh: Mesh | None = None,
    sharding_rule: ShardingRule = replicated_rule,
    deltas: Deltas | None = None,
) -> M:
    """loader.load_module for any weights open_weights reads: built abstractly (or `build`, an abstract
    module already), then loaded (with `deltas` merged), the linears a quantized file keeps held in
    their stored form."""
    checkpoint = open_weights(directory)
    if deltas is not None and isinstance(checkpoint, QuantizedCheckpoint):
        checkpoint.deltas = deltas
    return load_from(checkpoint, build, plan_for, mesh, sharding_rule, deltas,
                     prepare=lambda model, plan: prepare(model, plan, checkpoint)[:2])


def component_forms(directory: str | Path, model: nnx.Module, plan_for: Callable[[Any], KeyPlan]
                    ) -> tuple[tuple[str, str], ...]:
    """The kept forms of a component folder's weights as sorted (dotted module path, form) pairs: what
    the compile specs build the abstract model with (empty for anything but a quantized file).
    Reads the file's header only."""
    if quantized_file(directory) is None:
        return ()
    forms = kept_forms(open_weights(directory), model, plan_for(model))
    return tuple(sorted((".".join(path), name) for path, name in forms.items()))

