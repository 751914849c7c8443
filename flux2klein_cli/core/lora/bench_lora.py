"""Time merging LoRAs into a transformer at load: the plain load, then with random LoRAs of given
ranks on every linear module (ai-toolkit / BFL layout), in one process (page cache warm after a
first, untimed load). Writes the 4B-geometry transformer (random weights) when asked.

    python -m flux2klein_cli.core.lora.bench_lora DIR [--write 4b] [--ranks 16,64] [--dtype bf16] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from flux2klein_cli.core.lora.files import LoraSpec
from flux2klein_cli.core.lora.merge import LoraDeltas
from flux2klein_cli.core.lora.random_lora import write_random_lora
from flux2klein_cli.core.models.transformer import load_transformer


def _timed(transformer: Path, dtype: object, specs: list[LoraSpec]) -> float:
    start = time.perf_counter()
    model = load_transformer(transformer, dtype=dtype, deltas=LoraDeltas.read(specs))
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - start
    del model
    return seconds


def bench_lora(root: Path, ranks: list[int], dtype: str, reps: int) -> dict[str, object]:
    transformer = root / "transformer"
    target = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[dtype]
    _timed(transformer, target, [])  # warm the page cache
    result: dict[str, object] = {"plain_s": min(_timed(transformer, target, []) for _ in range(reps))}
    for rank in ranks:
        path = write_random_lora(root / f"lora-r{rank}.safetensors", transformer, "bfl", rank=rank, alpha=rank)
        result[f"rank{rank}_s"] = min(_timed(transformer, target, [LoraSpec(str(path))]) for _ in range(reps))
        result[f"rank{rank}_file_mb"] = round(path.stat().st_size / 2**20, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--write", default=None, help="write this random geometry's transformer first (e.g. 4b)")
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    if args.write:
        from flux2klein_cli.core.random_checkpoint import write_random_checkpoint

        write_random_checkpoint(args.root, args.write, components=["transformer"])
    ranks = [int(r) for r in args.ranks.split(",")]
    print(json.dumps(bench_lora(args.root, ranks, args.dtype, args.reps)))


if __name__ == "__main__":
    main()
