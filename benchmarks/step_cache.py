"""Step caching against the uncached loop: per-image time and SSIM of the same seed's image.

On a base (undistilled) checkpoint with real CFG: for each cache setting, what it skipped, its
image's SSIM against the uncached image, and the per-image time ratio, measured A/B interleaved
in one process (uncached, then each setting, REPS rounds after a warm-up; medians). Prints one
JSON object. The medium geometry with random weights is written once as a base checkpoint:

    python benchmarks/step_cache.py --model /tmp/flux2klein-round/medium-base --size 256 --steps 50 \\
        --cache fbcache:0.12 --cache dbcache:0.12 --cache dbcache+taylorseer:0.12

A setting is MODE[+taylorseer]:THRESHOLD[:WARMUP[:MAX_SKIPS[:BLOCKS]]] (omitted: the defaults).
`--reps 0` measures quality and skips only (one run each, for a threshold sweep). The timed rounds
follow the quality runs, which compiled every program.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM (Wang et al. 2004: Gaussian window sigma 1.5, K1 0.01, K2 0.03) over the RGB
    channels of two (H, W, 3) uint8 images."""
    from scipy.ndimage import gaussian_filter

    x, y = a.astype(np.float64), b.astype(np.float64)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    scores = []
    for ch in range(x.shape[-1]):
        xs, ys = x[..., ch], y[..., ch]
        blur = lambda v: gaussian_filter(v, 1.5, truncate=3.5)  # noqa: E731 (an 11x11 window)
        mx, my = blur(xs), blur(ys)
        vx, vy, cov = blur(xs * xs) - mx * mx, blur(ys * ys) - my * my, blur(xs * ys) - mx * my
        s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
        scores.append(float(s.mean()))
    return float(np.mean(scores))


def setting_fields(text: str) -> dict[str, Any]:
    """A setting MODE[+taylorseer]:THRESHOLD[:WARMUP[:MAX_SKIPS[:BLOCKS]]] as RunFields' cache fields."""
    mode, *numbers = text.split(":")
    mode, _, extra = mode.partition("+")
    names = ("cache_threshold", "cache_warmup", "cache_max_skips", "cache_blocks")
    values = {name: (float(n) if name == "cache_threshold" else int(n))
              for name, n in zip(names, numbers, strict=False)}
    return {"cache": mode, **values, **({"cache_taylorseer": True} if extra == "taylorseer" else {})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, type=Path, help="a base checkpoint (written with --preset if absent)")
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--cache", action="append", default=[], help="a setting, several times")
    args = parser.parse_args()

    from flux2klein_cli.core.engine.engine import EngineOptions
    from flux2klein_cli.core.engine.opening import Opening
    from flux2klein_cli.core.engine.plan import RunFields
    from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
    from flux2klein_cli.core.hub.snapshot import resolve_model

    if not (args.model / "model_index.json").is_file():
        write_random_checkpoint(args.model, args.preset, distilled=False)
    engine = Opening(EngineOptions(model=str(args.model), dtype=args.dtype, store=False), resolve_model).load(
        lambda message: None)
    settings = [setting_fields(s) for s in args.cache]

    def run(cache: dict[str, Any], seed: int) -> tuple[Any, float]:
        plan = engine.plan(RunFields(prompts=("a lighthouse on a cliff at dawn, oil painting",), steps=args.steps,
                                     guidance=args.guidance, height=args.size, width=args.size, seed=seed,
                                     negative_prompt="blurry", **cache))
        start = time.perf_counter()
        result = engine.run(plan)
        seconds = time.perf_counter() - start
        skipped = None if result.cache is None else result.cache["skipped_steps"]
        phases = {k: round(v, 1) for k, v in result.seconds.items() if k != "total"}
        print(f"{cache or 'uncached'} seed {seed}: {seconds:.1f} s {phases}, skipped {skipped}", file=sys.stderr,
              flush=True)
        return result, seconds

    # Quality first: each seed's uncached image, then each setting's; these runs also compile
    # every program, so the timed rounds below load nothing.
    rows: list[dict[str, Any]] = [{"ssim": [], "skipped_steps": [], "blocks_skipped": [], "differences": []}
                                  for _ in settings]
    for seed in args.seeds:
        plain, _ = run({}, seed)
        for cache, row in zip(settings, rows, strict=True):
            cached, _ = run(cache, seed)
            row["setting"] = {k: v for k, v in cached.cache.items() if k.startswith("cache")}
            row["ssim"].append(round(ssim(plain.images[0], cached.images[0]), 4))
            row["skipped_steps"].append(cached.cache["skipped_steps"])
            row["blocks_skipped"].append(f"{cached.cache['blocks_skipped']}/{cached.cache['blocks_total']}")
            row["differences"].append(cached.cache["differences"])
    uncached: dict[str, Any] = {}
    if args.reps:
        times: list[list[float]] = [[] for _ in range(len(settings) + 1)]
        denoise: list[list[float]] = [[] for _ in range(len(settings) + 1)]
        for _ in range(args.reps):  # A/B interleaved: each round times every setting once
            for i, cache in enumerate([{}, *settings]):
                result, seconds = run(cache, args.seeds[0])
                times[i].append(seconds)
                denoise[i].append(result.seconds["denoise"])
        base = statistics.median(times[0])
        for row, t in zip(rows, times[1:], strict=True):
            row["seconds_median"] = round(statistics.median(t), 3)
            row["speedup_median"] = round(base / statistics.median(t), 3)
            row["speedup_per_round"] = [round(a / b, 3) for a, b in zip(times[0], t, strict=True)]
        for row, d in zip(rows, denoise[1:], strict=True):
            row["denoise_speedup_median"] = round(statistics.median(denoise[0]) / statistics.median(d), 3)
        uncached = {"seconds_median": round(base, 3), "seconds": [round(t, 3) for t in times[0]]}
    print(json.dumps({"model": str(args.model), "size": args.size, "steps": args.steps, "guidance": args.guidance,
                      "dtype": args.dtype, "seeds": args.seeds, "reps": args.reps, "uncached": uncached,
                      "settings": rows}, indent=1))


if __name__ == "__main__":
    main()
