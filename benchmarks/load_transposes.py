"""The safetensors load with its transposing copies in numpy against the CPU kernel shim's, in fresh
processes, interleaved (docs/benchmarks.md). Each process loads one component of a diffusers snapshot
into `--dtype` and waits for every parameter; the `shim` process opens the shim first, as a run on a
CPU whose kernel plugin loads does before it loads weights. Needs a CPU with AVX-512 bf16.

    python -m flux2klein_cli.core.hub.random_checkpoint /tmp/b4/t4b --preset 4b --components transformer,scheduler
    python benchmarks/load_transposes.py /tmp/b4/t4b --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = """
import sys, time
import jax, jax.numpy as jnp
from flux2klein_cli.core.models import cpu_shim, qwen3, transformer, vae
if {path!r} == "shim":
    lib, why = cpu_shim.open_shim()
    if lib is None:
        raise SystemExit(f"the shim does not open: {{why}}")
else:
    cpu_shim.transposer = lambda: None
loaders = {{"transformer": transformer.load_transformer, "text_encoder": qwen3.load_qwen3, "vae": vae.load_vae}}
load = loaders[{component!r}]
start = time.perf_counter()
model = load({directory!r}, dtype=getattr(jnp, {dtype!r}))
jax.block_until_ready(jax.tree.leaves(model))
print(time.perf_counter() - start)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--component", default="transformer", choices=("transformer", "text_encoder", "vae"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    directory = str((args.model_dir / args.component).resolve())
    seconds: dict[str, list[float]] = {"numpy": [], "shim": []}
    for _ in range(args.rounds):
        for path in seconds:
            code = _CHILD.format(path=path, component=args.component, directory=directory, dtype=args.dtype)
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{path}: {done.stderr.strip()[-500:]}")
            seconds[path].append(float(done.stdout.split()[-1]))
            print(f"{path}: {seconds[path][-1]:.2f} s", flush=True)
    for path, runs in seconds.items():
        print(f"{path}: median {statistics.median(runs):.2f} s ({min(runs):.2f}-{max(runs):.2f}), {len(runs)} runs")


if __name__ == "__main__":
    main()
