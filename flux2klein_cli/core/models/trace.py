"""The backend dispatch: what a program is traced for, as one object, and the dots that follow it.

The models pick their forms while being traced, from the TraceOptions in force: by default the
local backend's (`TraceOptions.local()`), and inside `tracing(options)` the given ones. The
program functions (core/pipeline) take the options explicitly and trace under them, so a TPU
program compiled from a CPU host gets the TPU forms without touching anything global, and
core/compile puts the options in its key. The options decide:

  * the attention form (`attention`) and the VAE's convolution form (`convs_as_matmuls`);
  * how a bf16 model computes (`bf16_compute`, `dot_general`, `conv_general_dilated`,
    `promote_dtype`, `activation_dtype`): as written on TPU and GPU (their units accumulate in
    float32 inside); on CPU every dot and convolution accumulates in float32, with bf16 operands
    where the CPU has a bf16 dot instruction, and elsewhere with float32 activations throughout
    (the weights stay bf16 in memory and are widened where they are used): such a CPU has no bf16
    arithmetic, and XLA widens every bf16 operand to float32 anyway;
  * a kernel plugin (`kernels`): on CPUs with AMX and oneMKL the AMX plugin
    (core/models/amx_plugin.py) takes the Linear dots, attention and the VAE's 3x3 convolutions,
    and the other x86 CPUs' plugins what XLA runs slowly there; each is imported only where it
    applies (core/models/kernels.py);
  * int8 models' dots (`int8_compute`) and what idle mesh axes do (`idle_axes`).

Layers ask the options, never the process: no `jax.default_backend()` in model code.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from flux2klein_cli.core import settings
from flux2klein_cli.core.models import kernels

# splash: Pallas's TPU kernel; splash-interpret: the same kernel interpreted (the TPU path on
# any host, for tests); cudnn: cuDNN's fused kernel; blocked: the query-blocked CPU form;
# xla: XLA's own form, which materialises every score.
ATTENTION_KINDS = ("splash", "splash-interpret", "cudnn", "blocked", "xla")
# How a bf16 model computes. bf16: as written, a dot's result bf16 (TPU, GPU); f32-accumulate: bf16
# operands, each dot's and convolution's float32 result rounded to bf16 once (CPUs with a bf16 dot
# instruction, where XLA's kernel takes bf16 in); f32: activations float32 throughout, bf16 weights
# widened where used (CPUs without one, where XLA's bf16-in kernel is slower than its float32 one).
BF16_COMPUTE_FORMS = ("bf16", "f32-accumulate", "f32")
IDLE_FORMS = settings.IDLE_AXES_CHOICES
# Where `--effort fast` traces the VAE's 3x3 convolutions as matmuls: libtpu compiles them far
# quicker; elsewhere they cost compile and run time (docs/benchmarks.md, "Ahead-of-time compilation").
MATMUL_CONV_PLATFORMS = frozenset({"tpu"})
INT8_COMPUTE_KINDS = settings.INT8_COMPUTE_CHOICES


@dataclass(frozen=True)
class TraceOptions:
    platform: str  # the backend the program runs on: cpu, gpu, tpu
    attention: str  # one of ATTENTION_KINDS
    convs_as_matmuls: bool = False  # the VAE's 3x3 convolutions as one matmul each (models/vae.py)
    idle_axes: str = "auto"  # one of IDLE_FORMS (core/devices/sharding.py)
    int8_compute: str = "weight-only"  # one of INT8_COMPUTE_KINDS (int8 models only)
    kernels: str | None = None  # one of kernels.PLUGINS, or None: XLA's own forms
    bf16_compute: str = "bf16"  # one of BF16_COMPUTE_FORMS

    def __post_init__(self) -> None:
        for field, value, allowed in (("attention", self.attention, ATTENTION_KINDS),
                                      ("idle_axes", self.idle_axes, IDLE_FORMS),
                                      ("int8_compute", self.int8_compute, INT8_COMPUTE_KINDS),
                                      ("kernels", self.kernels, (None, *kernels.PLUGINS)),
                                      ("bf16_compute", self.bf16_compute, BF16_COMPUTE_FORMS)):
            if value not in allowed:
                raise ValueError(f"{field} {value!r} is not one of {allowed}")

    @classmethod
    def for_platform(cls, platform: str, *, effort: str = "default", build: bool = True) -> TraceOptions:
        """The forms a run on `platform` at compile `effort` takes, with the settings that may change them
        (core/settings.py: FLUX2KLEIN_GPU_ATTENTION, FLUX2KLEIN_IDLE_AXES, FLUX2KLEIN_INT8_COMPUTE,
        FLUX2KLEIN_CPU_MATMUL). A CPU program runs on this host, so its forms follow this CPU. `build`
        False (a report): a kernel plugin whose shim is not built yet is named, not built."""
        if platform == "tpu":
            attention = "splash"
        elif platform == "cpu":
            attention = "blocked"
        elif platform == "gpu" and settings.gpu_attention() == "cudnn":
            attention = "cudnn"
        else:
            attention = "xla"
        status = kernels.plugin_status if build else kernels.report_status
        plugin, bf16_compute = (status().name, kernels.cpu_bf16_compute()) if platform == "cpu" else (None, "bf16")
        convs_as_matmuls = effort == "fast" and platform in MATMUL_CONV_PLATFORMS
        return cls(platform, attention, convs_as_matmuls, idle_axes=settings.idle_axes(),
                   int8_compute=settings.int8_compute(), kernels=plugin, bf16_compute=bf16_compute)

    @classmethod
    def local(cls) -> TraceOptions:
        return cls.for_platform(jax.default_backend())

    def as_key(self) -> dict[str, Any]:
        key = asdict(self)
        # Defaults that came after the key's first form are left out, so they leave it as it was.
        for field, default in (("int8_compute", "weight-only"), ("kernels", None), ("bf16_compute", "bf16")):
            if key[field] == default:
                del key[field]
        return key

    @property
    def weights_as_words(self) -> bool:
        """Whether stacked bf16 weights enter the programs as uint16 words (models/layers.py)."""
        return self.platform == "cpu"

    @property
    def convert_per_pass(self) -> bool:
        """Whether a reduction that reads an activation twice (GroupNorm's mean, then its variance)
        converts it to float32 in each pass: XLA's CPU backend otherwise writes the first pass's
        float32 copy of a bf16 activation to memory for the second (models/vae.py)."""
        return self.platform == "cpu"

    def activation_dtype(self, dtype: Any) -> Any:
        """The dtype a model of `dtype` (its weights') computes its activations in."""
        return jnp.float32 if self.bf16_compute == "f32" and dtype == jnp.bfloat16 else dtype

    def for_vae(self) -> TraceOptions:
        """The forms the VAE traces in (models/vae.py, its encode and decode): these, except that a bf16 VAE
        computes with float32 activations under the AVX-512 bf16 plugin too, as on a CPU without bf16. Its
        float32 3x3 convolutions take Winograd's form, up to 4x fewer products at half VDPBF16PS's rate,
        where its bf16 ones take the nine taps (docs/benchmarks.md). The AMX plugin's bf16 convolutions run
        on the tiles, faster again."""
        if self.kernels == "avx512-bf16" and self.bf16_compute == "f32-accumulate":
            return replace(self, bf16_compute="f32")
        return self

    def int8_dot_result(self, dtype: Any) -> Any:
        """The result dtype of an int8-weight dot with `dtype` activations: the activation dtype on
        TPU (the MXU accumulates in float32 inside; asked for a float32 result, libtpu wrote the
        whole float32 product to memory before scaling it), float32 elsewhere (on CPU the
        bf16-result dot made the medium model's denoise loop 2x slower)."""
        return dtype if self.platform == "tpu" else jnp.float32


_CURRENT: contextvars.ContextVar[TraceOptions | None] = contextvars.ContextVar("trace_options", default=None)


def current() -> TraceOptions:
    """The options the model code traces under now."""
    return _CURRENT.get() or TraceOptions.local()


@contextlib.contextmanager
def tracing(options: TraceOptions | None) -> Iterator[None]:
    """Trace under `options` within the block (None: leave them as they are)."""
    if options is None:
        yield
        return
    token = _CURRENT.set(options)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def traced_under(fn: Callable[..., Any], options: TraceOptions | None) -> Callable[..., Any]:
    """`fn` traced under `options` (itself when None): for the function a program jits."""
    if options is None:
        return fn

    def traced(*args: Any) -> Any:
        with tracing(options):
            return fn(*args)

    return traced


def jit_program(fn: Callable[..., Any], options: TraceOptions | None) -> jax.stages.Wrapped:
    """`fn` jitted as a program: traced under `options` (None: the local backend's forms), and on
    this host's CPU compiled with its options (devices/cpu.py), so that a program run without the
    executable store compiles as a stored one does (core/compile/target.py)."""
    from flux2klein_cli.core.devices import cpu

    platform = options.platform if options is not None else jax.default_backend()
    host = cpu.xla_options() if platform == "cpu" else {}
    return jax.jit(traced_under(fn, options), compiler_options=host or None)


def plugin(options: TraceOptions | None = None) -> ModuleType | None:
    """The kernel plugin module the options name (None: XLA's own forms)."""
    name = (options or current()).kernels
    return None if name is None else kernels.plugin_module(name)


# ----------------------------------------------------------------------------- dots


def _widened(lhs: jax.Array, rhs: jax.Array, preferred_element_type: Any,
             options: TraceOptions) -> tuple[jax.Array, jax.Array, Any, Any] | None:
    """For a bf16 x bf16 product that accumulates in float32 under `options`: the operands as
    the form takes them, the result dtype to ask for, and the dtype to round it to; else None.
    (In the f32 form the layers widen their operands before the product; one that comes bf16
    anyway is widened here.)"""
    if options.bf16_compute == "bf16" or lhs.dtype != jnp.bfloat16 or rhs.dtype != jnp.bfloat16:
        return None
    if preferred_element_type not in (None, jnp.bfloat16, jnp.float32):
        return None
    out = preferred_element_type or jnp.bfloat16
    if options.bf16_compute == "f32":
        lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    return lhs, rhs, jnp.float32, out


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any = None,
                preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
    """`lax.dot_general` in the form the trace options name: every Linear layer's dot (nnx.Linear's
    `dot_general`) and the VAE's 1x1 convolutions. The kernel plugin's where it takes the
    operands; else XLA's, a bf16 one accumulated in float32 where `bf16_compute` says so."""
    options = current()
    kernels_module = plugin(options)
    if kernels_module is not None and kernels_module.dot_eligible(lhs, rhs, dimension_numbers,
                                                                  preferred_element_type, kwargs):
        def xla(x: jax.Array, w: jax.Array) -> jax.Array:
            return _xla_dot(x, w, dimension_numbers, precision, preferred_element_type, kwargs, options)

        return kernels_module.dot_general(lhs, rhs, preferred_element_type, xla)
    return _xla_dot(lhs, rhs, dimension_numbers, precision, preferred_element_type, kwargs, options)


def _xla_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, precision: Any, preferred_element_type: Any,
             kwargs: dict[str, Any], options: TraceOptions) -> jax.Array:
    widened = _widened(lhs, rhs, preferred_element_type, options)
    if widened is None:
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
    lhs, rhs, acc, out = widened
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=acc,
                               **kwargs).astype(out)


def conv_general_dilated(lhs: jax.Array, rhs: jax.Array, window_strides: Any, padding: Any, *args: Any,
                         preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
    """`lax.conv_general_dilated` in the form the trace options name (nnx.Conv's
    `conv_general_dilated`): a bf16 one accumulated in float32 where `bf16_compute` says so."""
    widened = _widened(lhs, rhs, preferred_element_type, current())
    if widened is None:
        return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, *args,
                                            preferred_element_type=preferred_element_type, **kwargs)
    lhs, rhs, acc, out = widened
    return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, *args, preferred_element_type=acc,
                                        **kwargs).astype(out)


def promote_dtype(args: tuple[Any, ...], *, dtype: Any = None, inexact: bool = True) -> Any:
    """nnx.Linear's and nnx.Conv's `promote_dtype`: inputs, kernel and bias in the dtype the
    module's (`dtype`) computes in under the trace options (`TraceOptions.activation_dtype`)."""
    from flax.nnx.nn.dtypes import promote_dtype as promote

    return promote(args, dtype=None if dtype is None else current().activation_dtype(dtype), inexact=inexact)
