"""Weight-only int8 linears: the kernel stored as int8 per output channel, with float32 scales.

`int8_matmul` is the whole computation: the int8 kernel is converted to the activation dtype
inside the dot (XLA fuses the convert into the dot's operand, so no dequantized copy of the
kernel is ever held: libtpu's dot reads the int8 kernel itself), the dot accumulates in float32,
and the per-channel scale multiplies the output, not the weight. int8 values (|q| <= 127) are
exact in bf16, so the error is the rounding of the weights (and, in a bf16 model on TPU, one
more rounding of each product).

With FLUX2KLEIN_INT8_COMPUTE=dynamic (an opt-in trace option, core/models/trace.py)
`int8_dynamic_matmul` is used instead: each token's activations are rounded to int8 with their
own scale (max |x| / 127), the dot is int8 x int8 accumulated in int32 (the chips with fast
int8 run it natively), and both scales multiply the output.

Which linears are quantized is `QUANTIZED_STACKS` (one home, used by convert, load and compile):
every linear inside the scanned blocks of the transformer and the text encoder; the text
encoder's token table is int8 per row (`QuantizedEmbed`: a lookup, then its row's scale).
docs/models.md says why the rest stays in the model dtype.

Files that arrive quantized (core/weights/prequantized.py: GGUF Q8_0, ComfyUI fp8) keep their
own forms (`WEIGHT_FORMS`) in the same QuantizedLinear: Q8_0's int8 values with one float16
scale per block of 32 input rows (a scale of shape (in / 32, out), applied to the kernel before
the dot, as Q8_0 defines it), fp8 (e4m3) values with one scale per output channel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flux2klein_cli.core.choices import QUANTIZE
from flux2klein_cli.core.models import trace

SCHEMES = tuple(s for s in QUANTIZE if s != "none")  # "none" leaves every weight in the model dtype
QUANTIZED_STACKS = ("transformer_blocks", "single_transformer_blocks", "layers")
SCALE_DTYPE = jnp.float32


def int8_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array) -> jax.Array:
    """x (..., in) @ (kernel (in, out) int8 * scale (out,)) in x's dtype, accumulated in float32
    (on TPU the dot rounds to x's dtype before the scale: one more rounding in a bf16 model).
    A kernel of fp8 values works the same; a scale per block of input rows (G, out) goes to
    `block_matmul`."""
    if scale.ndim == kernel.ndim:
        return block_matmul(x, kernel, scale)
    result = trace.current().int8_dot_result(x.dtype)  # the backend dispatch's rule
    y = jax.lax.dot_general(x, kernel.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())),
                            preferred_element_type=result)
    return (y.astype(jnp.float32) * scale.astype(jnp.float32)).astype(x.dtype)


def block_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array) -> jax.Array:
    """x (..., in) @ kernel (in, out) whose rows are scaled per block: scale (G, out), one value for
    each in / G consecutive input rows of an output channel (GGUF Q8_0). The kernel is scaled in
    float32 (exactly what Q8_0's dequantization computes), cast to x's dtype, then the dot: within
    a scanned stack only one layer's scaled kernel exists at a time."""
    groups, out = scale.shape
    w = kernel.astype(jnp.float32).reshape(groups, -1, out) * scale.astype(jnp.float32)[:, None, :]
    y = jax.lax.dot_general(x, w.reshape(kernel.shape).astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def int8_dynamic_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array) -> jax.Array:
    """x (..., in) rounded to int8 per token (symmetric, scale max |x| / 127 over `in`), times
    the int8 kernel (in, out) accumulated in int32, times both scales; in x's dtype."""
    x32 = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    x_scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    xq = jnp.clip(jnp.round(x32 / x_scale), -127, 127).astype(jnp.int8)
    y = jax.lax.dot_general(xq, kernel, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return (y.astype(jnp.float32) * x_scale * scale.astype(jnp.float32)).astype(x.dtype)


class QuantizedLinear(nnx.Module):
    """nnx.Linear's call with an int8 kernel (in, out) and a float32 scale (out,)."""

    def __init__(self, kernel: nnx.Param, scale: nnx.Param, bias: nnx.Param | None):
        self.kernel, self.scale, self.bias = kernel, scale, bias

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel, scale = self.kernel[...], self.scale[...]
        # Dynamic int8 x int8 dots need int8 values with one scale per output channel.
        dynamic = trace.current().int8_compute == "dynamic" and kernel.dtype == jnp.int8 and scale.ndim < kernel.ndim
        y = (int8_dynamic_matmul if dynamic else int8_matmul)(x, kernel, scale)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


class QuantizedEmbed(nnx.Module):
    """nnx.Embed's lookup from an int8 table (V, D) with a float32 scale per row (token)."""

    def __init__(self, embedding: nnx.Param, scale: nnx.Param, dtype: Any):
        self.embedding, self.scale, self.dtype = embedding, scale, dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        rows = jnp.take(self.embedding[...], ids, axis=0).astype(jnp.float32)
        return (rows * jnp.take(self.scale[...], ids, axis=0)[..., None]).astype(self.dtype)


def quantized_embed_paths(model: nnx.Module) -> list[tuple[str, ...]]:
    """Token tables quantized per row: the text encoder's (a tenth of Qwen3's bytes)."""
    return [tuple(str(p) for p in path) for path, module in nnx.iter_modules(model)
            if isinstance(module, nnx.Embed) and path and str(path[-1]) == "embed_tokens"]


def quantized_linear_paths(model: nnx.Module) -> list[tuple[str, ...]]:
    """Module paths of the linears `quantize_abstract` replaces, in graph order."""
    return [tuple(str(p) for p in path) for path, module in nnx.iter_modules(model)
            if isinstance(module, nnx.Linear) and path and str(path[0]) in QUANTIZED_STACKS]


def quantize_abstract(model: nnx.Module, scheme: str | None) -> nnx.Module:
    """An abstract model (from nnx.eval_shape) with its quantized linears swapped for
    QuantizedLinear holding int8 kernel and float32 scale shapes (a stacked linear keeps its
    leading layer axis on both). A no-op for scheme None / "none". Modifies `model` in place."""
    if scheme in (None, "none"):
        return model
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}")
    modules = {tuple(str(p) for p in path): module for path, module in nnx.iter_modules(model)}
    for path in quantized_linear_paths(model):
        linear = modules[path]
        kernel = linear.kernel.get_value()
        _replace(modules[path[:-1]] if len(path) > 1 else model, path[-1], QuantizedLinear(
            nnx.Param(jax.ShapeDtypeStruct(kernel.shape, jnp.int8)),
            nnx.Param(jax.ShapeDtypeStruct((*kernel.shape[:-2], kernel.shape[-1]), SCALE_DTYPE)),
            linear.bias if getattr(linear, "bias", None) is not None else None,
        ))
    for path in quantized_embed_paths(model):
        table = modules[path].embedding.get_value()
        _replace(modules[path[:-1]] if len(path) > 1 else model, path[-1], QuantizedEmbed(
            nnx.Param(jax.ShapeDtypeStruct(table.shape, jnp.int8)),
            nnx.Param(jax.ShapeDtypeStruct(table.shape[:1], SCALE_DTYPE)),
            modules[path].dtype,
        ))
    return model


@dataclass(frozen=True)
class WeightForm:
    """How a prequantized linear's kernel is held: `values` (its dtype) and `scale` (dtype), one
    scale per `block` input rows of each output channel, or per output channel (block None)."""

    name: str
    values: Any
    scale: Any
    block: int | None = None

    def scale_shape(self, kernel_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale's shape for a kernel (..., in, out)."""
        *lead, rows, out = kernel_shape
        return (*lead, out) if self.block is None else (*lead, rows // self.block, out)


# Forms kept as they are stored (core/weights/prequantized.py decides which linears keep them).
WEIGHT_FORMS = {
    "q8_0": WeightForm("q8_0", jnp.int8, jnp.float16, 32),  # GGUF Q8_0: its float16 block scales, exact
    "fp8": WeightForm("fp8", jnp.float8_e4m3fn, jnp.float32),  # ComfyUI float8_e4m3fn, scale per tensor
}


def prequantize_abstract(model: nnx.Module, forms: Mapping[tuple[str, ...], str]) -> nnx.Module:
    """An abstract model with the linears at `forms`' paths swapped for QuantizedLinear holding
    that form's value and scale shapes (`WEIGHT_FORMS`). Modifies `model` in place."""
    modules = {tuple(str(p) for p in path): module for path, module in nnx.iter_modules(model)}
    for path, name in forms.items():
        form, linear = WEIGHT_FORMS[name], modules[path]
        kernel = linear.kernel.get_value()
        _replace(modules[path[:-1]] if len(path) > 1 else model, path[-1], QuantizedLinear(
            nnx.Param(jax.ShapeDtypeStruct(kernel.shape, form.values)),
            nnx.Param(jax.ShapeDtypeStruct(form.scale_shape(tuple(kernel.shape)), form.scale)),
            linear.bias if getattr(linear, "bias", None) is not None else None,
        ))
    return model


def held_forms(model: nnx.Module) -> dict[str, int]:
    """How many of a model's linears are held quantized, by form: "int8" (convert --quantize int8, a
    scale per output channel) or a WEIGHT_FORMS name (a scanned stack counts once)."""
    counts: dict[str, int] = {}
    for _, module in nnx.iter_modules(model):
        if isinstance(module, QuantizedLinear):
            kernel, scale = module.kernel.get_value(), module.scale.get_value()
            name = next((n for n, f in WEIGHT_FORMS.items() if jnp.dtype(f.values) == kernel.dtype
                         and (f.block is None) == (scale.ndim < kernel.ndim)), "int8")
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def _replace(parent: nnx.Module, name: str, module: nnx.Module) -> None:
    """Swap the child `name` of `parent`: an attribute, or an item of an nnx.List (`to_out.0`)."""
    if isinstance(parent, nnx.List):
        parent[int(name)] = module
    else:
        setattr(parent, name, module)


def quantize_weights(w: Any) -> tuple[Any, Any]:
    """Host-side (numpy) symmetric int8 of a float kernel (..., in, out) (a stacked one has
    leading layer axes), given nothing else: (int8 values, float32 scale (..., out) per output
    channel). Used by tests and small tools; convert streams the same arithmetic
    (core/weights/quantize.py)."""
    import numpy as np

    w = np.asarray(w, np.float32)
    scale = scale_from_absmax(np.abs(w).max(axis=-2))
    return round_to_int8(w, scale[..., None, :]), scale


def scale_from_absmax(absmax: Any) -> Any:
    import numpy as np

    absmax = np.asarray(absmax, np.float32)
    return np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)


def round_to_int8(w: Any, scale: Any) -> Any:
    import numpy as np

    return np.clip(np.rint(np.asarray(w, np.float32) / scale), -127, 127).astype(np.int8)
