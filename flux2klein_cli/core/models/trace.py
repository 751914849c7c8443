"""What a program is traced for: one object instead of a switch per choice.

The models pick their attention and convolution forms while being traced, from the
TraceOptions in force: by default the local backend's (`TraceOptions.local()`), and inside
`tracing(options)` the given ones. The program functions (core/pipeline) take the options
explicitly and trace under them, so a TPU program compiled from a CPU host gets the TPU
forms without touching anything global, and core/compile puts the options in its key.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import jax

from flux2klein_cli.core.devices.sharding import IDLE_FORMS
from flux2klein_cli.core.errors import UserInputError

GPU_ATTENTION_ENV = "FLUX2KLEIN_GPU_ATTENTION"  # "xla": keep XLA's form on NVIDIA GPUs
# "dynamic": an int8 model's linears as int8 x int8 dots with per-token activation scales
# (models/quantized.py); "weight-only" (the default) keeps the activations in the model dtype.
INT8_COMPUTE_ENV = "FLUX2KLEIN_INT8_COMPUTE"
INT8_COMPUTE_KINDS = ("weight-only", "dynamic")
# splash: Pallas's TPU kernel; splash-interpret: the same kernel interpreted (the TPU path on
# any host, for tests); cudnn: cuDNN's fused kernel; blocked: the query-blocked CPU form;
# xla: XLA's own form, which materialises every score.
ATTENTION_KINDS = ("splash", "splash-interpret", "cudnn", "blocked", "xla")
# What the batch axes a batch leaves idle do (core/devices/sharding.py, IDLE_FORMS): "auto" (the rule),
# or "sequence" / "replicate" forced, for measuring one against the other.
IDLE_AXES_ENV = "FLUX2KLEIN_IDLE_AXES"


@dataclass(frozen=True)
class TraceOptions:
    platform: str  # the backend the program runs on: cpu, gpu, tpu
    attention: str  # one of ATTENTION_KINDS
    convs_as_matmuls: bool = False  # the VAE's 3x3 convolutions as one matmul each (models/vae.py)
    idle_axes: str = "auto"  # one of sharding.IDLE_FORMS
    int8_compute: str = "weight-only"  # one of INT8_COMPUTE_KINDS (int8 models only)
    # CPU programs on an AMX CPU with oneMKL (models/cpu_matmul.py): bf16 attention and the VAE's
    # 3x3 convolutions in its shim. (Linear layers' dots follow cpu_matmul.backend() itself.)
    onemkl: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention {self.attention!r} is not one of {ATTENTION_KINDS}")
        if self.idle_axes not in IDLE_FORMS:
            raise ValueError(f"idle axes {self.idle_axes!r} is not one of {IDLE_FORMS}")
        if self.int8_compute not in INT8_COMPUTE_KINDS:
            raise ValueError(f"int8_compute {self.int8_compute!r} is not one of {INT8_COMPUTE_KINDS}")

    @classmethod
    def for_platform(cls, platform: str, *, convs_as_matmuls: bool = False) -> TraceOptions:
        """The forms a run on `platform` takes (on a GPU, FLUX2KLEIN_GPU_ATTENTION may keep XLA's;
        FLUX2KLEIN_IDLE_AXES may force the idle axes' form; FLUX2KLEIN_INT8_COMPUTE=dynamic opts an
        int8 model into int8 x int8 dots)."""
        if platform == "tpu":
            attention = "splash"
        elif platform == "cpu":
            attention = "blocked"
        elif platform == "gpu" and os.environ.get(GPU_ATTENTION_ENV, "cudnn") == "cudnn":
            attention = "cudnn"
        else:
            attention = "xla"
        idle = os.environ.get(IDLE_AXES_ENV, "auto")
        if idle not in IDLE_FORMS:
            raise UserInputError(f"{IDLE_AXES_ENV}={idle!r}: use one of {', '.join(IDLE_FORMS)}")
        int8_compute = os.environ.get(INT8_COMPUTE_ENV) or "weight-only"
        if int8_compute not in INT8_COMPUTE_KINDS:
            raise UserInputError(f"{INT8_COMPUTE_ENV}={int8_compute!r}: use one of {', '.join(INT8_COMPUTE_KINDS)}")
        onemkl = False
        if platform == "cpu":
            from flux2klein_cli.core.models import cpu_matmul

            onemkl = cpu_matmul.backend() is not None
        return cls(platform, attention, convs_as_matmuls, idle_axes=idle, int8_compute=int8_compute, onemkl=onemkl)

    @classmethod
    def local(cls) -> TraceOptions:
        return cls.for_platform(jax.default_backend())

    def as_key(self) -> dict[str, Any]:
        key = asdict(self)
        if self.int8_compute == "weight-only":  # the default leaves the keys as they were before it
            del key["int8_compute"]
        if not self.onemkl:  # as for int8_compute
            del key["onemkl"]
        return key


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
