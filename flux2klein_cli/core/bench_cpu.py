"""CPU matmul and per-image figures beside torch and diffusers, interleaved in one process.

On a loaded host absolute times drift; the forms are timed in turn, round after round, and each
keeps its best, so their ratios hold. Needs torch and diffusers (the [parity] extra).

    python -m flux2klein_cli.core.bench_cpu matmul
    python -m flux2klein_cli.core.bench_cpu image /tmp/medium --dtype bf16 --size 512 --steps 4
`image` times ours with oneMKL's dots and with XLA's (core/models/cpu_matmul.py) in the same process.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flux2klein_cli.core.models import cpu_matmul


def interleave(forms: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Best seconds of each form; one warm-up call each, then `rounds` rounds in turn."""
    for f in forms.values():
        f()
    best = {k: float("inf") for k in forms}
    for _ in range(rounds):
        for k, f in forms.items():
            start = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - start)
    return best


def matmul(n: int, rounds: int) -> dict[str, Any]:
    import torch

    rng = np.random.default_rng(0)
    a32 = rng.standard_normal((n, n), np.float32)
    forms: dict[str, Callable[[], Any]] = {}
    for name, dt in (("bf16", jnp.bfloat16), ("fp32", jnp.float32)):
        a = jnp.asarray(a32, dt)
        plain = jax.jit(lambda x, y: jax.lax.dot_general(x, y, (((1,), (0,)), ((), ()))))
        hooked = jax.jit(lambda x, y: cpu_matmul.dot_general(x, y, (((1,), (0,)), ((), ()))))
        t = torch.from_numpy(a32).to(torch.bfloat16 if name == "bf16" else torch.float32)
        forms[f"jax xla {name}"] = lambda f=plain, a=a: f(a, a).block_until_ready()
        if name == "bf16" and cpu_matmul.backend():
            forms[f"jax onemkl {name}"] = lambda f=hooked, a=a: f(a, a).block_until_ready()
        forms[f"torch {name}"] = lambda t=t: t @ t
    best = interleave(forms, rounds)
    return {k: round(2 * n**3 / s / 1e9) for k, s in best.items()}


def image(model: str, dtype: str, size: int, steps: int, rounds: int) -> dict[str, Any]:
    """Per-image phases of ours, with oneMKL's dots (where active) and with XLA's, beside
    diffusers' whole call and its call up to the latents (text encoding and denoising)."""
    import diffusers
    import torch

    from flux2klein_cli.core.pipeline.pipeline import KleinPipeline, Request

    torch.set_num_threads(2)
    prompt = "a red fox in snow"
    request = Request(prompts=[prompt], steps=steps, guidance=1.0, height=size, width=size)
    real = cpu_matmul.status()
    forms: dict[str, Callable[[], Any]] = {}
    seconds: dict[str, dict[str, float]] = {}

    def ours(name: str, status: cpu_matmul.Status) -> None:
        # Each pipeline traces its programs on its first call; the choice made then stays.
        cpu_matmul.status = lambda: status  # type: ignore[assignment]
        pipe = KleinPipeline.load(model, dtype=jnp.bfloat16 if dtype == "bf16" else jnp.float32)
        pipe(request)

        def call() -> None:
            phases = pipe(request).seconds
            seconds[name] = {k: min(v, seconds.get(name, {}).get(k, v)) for k, v in phases.items()}

        forms[name] = call

    try:
        if real.name and dtype == "bf16":
            ours("flux2klein onemkl", real)
        ours("flux2klein xla", cpu_matmul.Status(None, "off"))
    finally:
        cpu_matmul.status = functools.cache(lambda: real)  # type: ignore[assignment]
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(model, dtype=torch.bfloat16 if dtype == "bf16"
                                                        else torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def theirs(output_type: str) -> Any:
        return pipe(prompt=prompt, height=size, width=size, num_inference_steps=steps, guidance_scale=1.0,
                    generator=torch.Generator().manual_seed(0), output_type=output_type)

    forms["diffusers"] = lambda: theirs("pil")
    forms["diffusers to latents"] = lambda: theirs("latent")
    best = interleave(forms, rounds)
    return {"whole_s": {k: round(v, 3) for k, v in best.items()},
            "ratio_to_diffusers": {k: round(v / best["diffusers"], 3) for k, v in best.items()},
            "phases_s": {k: {p: round(v, 3) for p, v in ph.items() if v} for k, ph in seconds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("matmul")
    m.add_argument("--n", type=int, default=2048)
    m.add_argument("--rounds", type=int, default=7)
    i = sub.add_parser("image")
    i.add_argument("model")
    i.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    i.add_argument("--size", type=int, default=512)
    i.add_argument("--steps", type=int, default=4)
    i.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    status = cpu_matmul.status()
    out = {"cpu_matmul": status.name, "why": status.reason}
    if args.what == "matmul":
        out["gflops"] = matmul(args.n, args.rounds)
    else:
        out.update(image(args.model, args.dtype, args.size, args.steps, args.rounds))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
