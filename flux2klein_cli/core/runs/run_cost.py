"""What a run will cost, known before any work: a peak-memory estimate from the shapes, and the
work in token-steps. (The largest size the model's positions address is the plan's size rule.)

The estimate is deliberately simple and on the safe side: every parameter, plus the largest
live activations of one transformer block for the whole batch (the denoise loop scans the
blocks, so one block's activations are alive at a time), including an attention score matrix
in float32 as XLA materialises it where no fused kernel applies.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flux2klein_cli.core.errors import UserInputError

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


def check_fits(cost: RunCost, available: int, where: str) -> None:
    """Refuse a run whose estimate is above the memory it has, saying what would fit."""
    if cost.peak_bytes <= available:
        return
    fit = cost.images_that_fit(available)
    hint = (f"at most --num-images {fit} in all (prompts x images) would fit" if fit >= 1
            else "a smaller --height/--width would fit")
    raise UserInputError(
        f"this run needs about {cost.peak_bytes / GIB:.1f} GiB ({cost.batch} image(s)), more than the "
        f"{available / GIB:.1f} GiB of {where}; {hint}"
    )


def describe_long_run(cost: RunCost) -> str | None:
    """One line for a run that will take long, or None."""
    if cost.token_steps <= LONG_RUN_TOKEN_STEPS:
        return None
    return (f"a long run: {cost.token_steps:,} token-steps ({cost.token_steps / 16384:.0f}x four steps of one "
            f"1024x1024 image), about {cost.peak_bytes / GIB:.1f} GiB")


def check_run_fits(mesh: Mesh | None, model_dir: str | Path, batch: int) -> None:
    """The mesh's divisibility checks for a model directory's transformer, before loading it."""
    if mesh is None:
        return
    from flux2klein_cli.core.devices.mesh import check_divides
    from flux2klein_cli.core.hub.checkpoint import Snapshot
    from flux2klein_cli.core.weights.configs import read_config

    config = read_config(Snapshot.open(model_dir).component("transformer"))
    check_divides(mesh, batch=batch, heads=int(config.get("num_attention_heads", 1)))
