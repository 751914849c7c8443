"""What a run will cost, known before any work: the largest size the model's positions can
address, a peak-memory estimate from the shapes, and the work in token-steps; `Admission`
applies them to every plan of every door.

The estimate is deliberately simple and on the safe side: every parameter, plus the largest
live activations of one transformer block for the whole batch (the denoise loop scans the
blocks, so one block's activations are alive at a time), including an attention score matrix
in float32 as XLA materialises it where no fused kernel applies.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flux2klein_cli.core.errors import FieldError

if TYPE_CHECKING:
    from jax.sharding import Mesh

# Beyond this many transformer token-steps (image tokens x steps x images) a run is announced:
# 4 steps of one 1024x1024 image is 16384; this is ~64 such images, minutes on a GPU, hours on a CPU.
LONG_RUN_TOKEN_STEPS = 1 << 20
GIB = 2**30


@dataclass(frozen=True)
class RunCost:
    parameter_bytes: int
    activation_bytes_per_image: int
    batch: int
    token_steps: int  # transformer tokens x steps x images (x2 with CFG): the work

    @property
    def peak_bytes(self) -> int:
        return self.parameter_bytes + self.activation_bytes_per_image * self.batch

    def images_that_fit(self, available: int) -> int:
        return max((available - self.parameter_bytes) // max(self.activation_bytes_per_image, 1), 0)


def materialises_scores(dtype_bytes: int) -> bool:
    """Whether attention holds its whole score matrix: XLA's own form on CPU, in fp32, or with
    FLUX2KLEIN_GPU_ATTENTION=xla; cuDNN's fused kernel (GPU) and the TPU kernel do not."""
    from flux2klein_cli.core.models.trace import TraceOptions

    attention = TraceOptions.local().attention
    if attention.startswith("splash"):
        return False
    if attention == "cudnn":
        return dtype_bytes == 4
    return True


def activation_bytes(transformer_config: dict[str, Any], image_tokens: int, text_tokens: int,
                     reference_tokens: int, dtype_bytes: int, scores: bool = True) -> int:
    """Largest live activations of one block for one image (one sequence); `scores`: attention
    holds its (heads, S, S) float32 probabilities."""
    heads = int(transformer_config.get("num_attention_heads", 24))
    dim = heads * int(transformer_config.get("attention_head_dim", 128))
    mlp = float(transformer_config.get("mlp_ratio", 3.0))
    tokens = image_tokens + text_tokens + reference_tokens
    # hidden state, q/k/v, the fused qkv+mlp projection and its output: ~(4 + 2 * mlp) x (S, D)
    linear = int(tokens * dim * (4 + 2 * mlp)) * dtype_bytes
    return linear + (heads * tokens * tokens * 4 if scores else 0)


def parameter_bytes(configs: dict[str, dict[str, Any]], dtype: Any) -> int:
    """Every parameter of the three models, from their abstract shapes (nothing is allocated)."""
    import jax
    from flax import nnx

    from flux2klein_cli.core.weights.converted import abstract_component

    total = 0
    for name, config in configs.items():
        state = nnx.state(abstract_component(name, config, dtype))
        total += sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "shape"))
    return total


def device_memory_bytes() -> tuple[int, str]:
    """Memory of the first local device, or the host's RAM when the device does not say (CPU)."""
    import jax

    device = jax.local_devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"


# The field a refusal for too many images names, and what its count is: a request's images, or the
# device batch a door makes of several requests (batch's --bs).
IMAGES_IN = {"num_images": "in all (prompts x images)", "batch_size": "in one device batch"}


def check_fits(cost: RunCost, available: int, where: str, images: str = "num_images") -> None:
    """Refuse a run whose estimate is above the memory it has, naming what to change (`images`,
    or the size) and what would fit."""
    if cost.peak_bytes <= available:
        return
    need = (f"this run needs about {cost.peak_bytes / GIB:.1f} GiB for {cost.batch} image(s), more than the "
            f"{available / GIB:.1f} GiB of {where}")
    fit = cost.images_that_fit(available)
    if fit >= 1:
        raise FieldError(images, f"asks too much: {need}; at most {fit} image(s) {IMAGES_IN[images]} would fit")
    raise FieldError("size", f"is too large: {need}; a smaller size would fit")


def describe_long_run(cost: RunCost) -> str | None:
    """One line for a run that will take long, or None."""
    if cost.token_steps <= LONG_RUN_TOKEN_STEPS:
        return None
    return (f"a long run: {cost.token_steps:,} token-steps ({cost.token_steps / 16384:.0f}x four steps of one "
            f"1024x1024 image), about {cost.peak_bytes / GIB:.1f} GiB")


def check_mesh(mesh: Mesh | None, transformer_config: dict[str, Any]) -> None:
    """The mesh's divisibility checks for a transformer, before loading it."""
    if mesh is not None:
        from flux2klein_cli.core.devices.mesh import check_divides

        check_divides(mesh, batch=1, heads=int(transformer_config.get("num_attention_heads", 1)))


class Demand:
    """What of a plan decides its memory and work (RunPlan has these attributes too): kept per
    item where a door holds many requests (batch) without their pixels."""

    __slots__ = ("batch", "height", "width", "reference_sizes", "max_sequence_length", "steps", "cfg", "geometry")

    def __init__(self, plan: Any, batch: int | None = None):
        for name in self.__slots__:
            setattr(self, name, getattr(plan, name))
        if batch is not None:
            self.batch = batch


class Admission:
    """What this host can hold, asked of every plan at every door (generate / edit, each batch
    item, each serve request) before any device work: the memory estimate against the device
    (a mesh spreads both over its devices: its own checks apply), and a word on long runs.
    `memory`: (bytes, where) instead of the first local device's."""

    def __init__(self, configs: Any, dtype: str, mesh: Mesh | None = None,
                 memory: tuple[int, str] | None = None):
        from flux2klein_cli.core.choices import jax_dtype

        self.transformer_config = configs.transformer
        self.mesh = mesh
        self.item_bytes = 4 if dtype == "fp32" else 2
        self.parameter_bytes = parameter_bytes(
            {"transformer": configs.transformer, "text_encoder": configs.text_encoder, "vae": configs.vae},
            jax_dtype(dtype))
        self.memory = memory if memory is not None or mesh is not None else device_memory_bytes()
        self.scores = materialises_scores(self.item_bytes)

    def cost(self, plan: Any) -> RunCost:
        geometry = plan.geometry
        image_tokens = geometry.tokens(plan.height, plan.width)
        ref_tokens = sum(geometry.tokens(h, w) for h, w in plan.reference_sizes)
        passes = 2 if plan.cfg else 1  # CFG: a second, negative pass
        return RunCost(
            parameter_bytes=self.parameter_bytes,
            activation_bytes_per_image=passes * activation_bytes(
                self.transformer_config, image_tokens, plan.max_sequence_length, ref_tokens, self.item_bytes,
                scores=self.scores),
            batch=plan.batch, token_steps=image_tokens * plan.steps * plan.batch * passes,
        )

    def check(self, plan: Any, images: str = "num_images") -> None:
        """A FieldError (`images`, or `size`) when the plan cannot fit the device's memory."""
        if self.memory is not None and self.mesh is None:
            check_fits(self.cost(plan), *self.memory, images)

    def long_run(self, plan: Any) -> str | None:
        """One line for a plan that will take long, or None."""
        return describe_long_run(self.cost(plan))
