"""One float32 3x3 convolution of the VAE at each of the real decoder's widths, in a kernel plugin of the
shim, beside the same channels at a size 2 less: a side that is a multiple of 4 takes Winograd's F(4x4, 3x3)
(unless its kernel is past one chunk's worth and the host has more cores than the image has chunks: then
F(2x2)), one that is only even F(2x2, 3x3) (cpu_kernels.cc's winograd_form), so each pair compares the two
forms where the host's core count keeps F(4x4).

Each figure is the best of three calls after a first one, in ms, with the GFLOP/s the nine-tap form's
products would need for that time.

    python benchmarks/conv_forms.py                      # the AVX-512 bf16 build's float32 kernels
    python benchmarks/conv_forms.py --plugin avx2-f32 --shapes 4
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from cpu_dots import best  # benchmarks/: a first call, then the best of three
from flax import nnx

from flux2klein_cli.core.models import avx512_bf16, float32_kernels
from flux2klein_cli.core.models.trace import TraceOptions, traced_under
from flux2klein_cli.core.models.vae import conv

# (side, channels): the 4B VAE's decoder layers at 512x512 and 1024x1024, each beside 2 less.
SHAPES = [(64, 512), (62, 512), (128, 512), (126, 512), (256, 256), (254, 256), (512, 128), (510, 128)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plugin", default="avx512-bf16", choices=["avx512-bf16", *float32_kernels.BY_NAME])
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="the first this many of SHAPES")
    opts = parser.parse_args()
    plugin = float32_kernels.BY_NAME.get(opts.plugin)
    why = plugin.load() if plugin is not None else avx512_bf16.load()
    if why is not None:
        raise SystemExit(f"the {opts.plugin} plugin does not run here: {why}")
    call = nnx.jit(traced_under(lambda m, x: m(x), TraceOptions("cpu", "blocked", kernels=opts.plugin)))
    for side, channels in SHAPES[: opts.shapes]:
        module = conv(channels, channels, 3, dtype=jnp.float32, rngs=nnx.Rngs(0))
        x = jnp.asarray(np.random.default_rng(0).standard_normal((1, side, side, channels)), jnp.float32)
        seconds = best(lambda module=module, x=x: jax.block_until_ready(call(module, x)))
        form = "side 4k" if side % 4 == 0 else "side 4k + 2"
        direct_gflop = 2 * 9 * side * side * channels * channels / 1e9
        print(f"{side}x{side} {channels}->{channels} {form}: {seconds * 1000:.1f} ms, "
              f"{direct_gflop / seconds:.0f} GFLOP/s of the nine taps' work", flush=True)


if __name__ == "__main__":
    main()
