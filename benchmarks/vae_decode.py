"""The float32 VAE decoder of the real FLUX.2 geometry (diffusers' AutoencoderKLFlux2 defaults: 128, 256,
512 and 512 channels) on this CPU, in a float32 kernel plugin of the shim: one decode at each size, the best
of three calls after a first, in seconds. Weights are zeros (a parameter-free build): the time of a
convolution does not depend on its values.

    python benchmarks/vae_decode.py                          # the AVX-512 float32 build, 512 and 1024
    python benchmarks/vae_decode.py --plugin avx2-f32 --sizes 512
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from cpu_dots import best  # benchmarks/: a first call, then the best of three
from flax import nnx

from flux2klein_cli.core.models import float32_kernels
from flux2klein_cli.core.models.trace import TraceOptions, traced_under
from flux2klein_cli.core.models.vae import build_vae
from flux2klein_cli.core.models.vae_config import VAEConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plugin", default="avx512-f32", choices=list(float32_kernels.BY_NAME))
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], help="output sides, multiples of 16")
    opts = parser.parse_args()
    why = float32_kernels.BY_NAME[opts.plugin].load()
    if why is not None:
        raise SystemExit(f"the {opts.plugin} plugin does not run here: {why}")
    vae = build_vae(VAEConfig(), dtype=jnp.float32)
    decode = nnx.jit(traced_under(lambda m, z: m.decode(z), TraceOptions("cpu", "blocked", kernels=opts.plugin)))
    for side in opts.sizes:
        grid = side // 16
        z = jnp.asarray(np.random.default_rng(0).standard_normal((1, grid, grid, vae.config.patched_channels)),
                        jnp.float32)
        seconds = best(lambda z=z: jax.block_until_ready(decode(vae, z)))
        print(f"{side}x{side}: {seconds:.3f} s", flush=True)


if __name__ == "__main__":
    main()
