"""`bench --phase ttfi`: time to first image, process start to PNG on disk, cold and warm,
optionally beside diffusers."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from flux2klein_cli.core import settings
from flux2klein_cli.core.choices import DTYPES
from flux2klein_cli.core.runs.bench.stats import summarize

_DIFFUSERS_TTFI = """
import sys, torch, diffusers
torch.set_num_threads({threads})
pipe = getattr(diffusers, {cls!r}).from_pretrained({model!r}, dtype=getattr(torch, {dtype!r}))
out = pipe(prompt={prompt!r}, height={height}, width={width}, num_inference_steps={steps}, guidance_scale={guidance},
           generator=torch.Generator().manual_seed(0))
out.images[0].save({out!r})
"""


def _timed_process(args: list[str], env: dict[str, str], output: Any) -> float:
    """Wall seconds from process start until it exits with the PNG on disk."""
    import subprocess

    Path(output).unlink(missing_ok=True)
    start = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0 or not Path(output).is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(args[:4])} ... failed: {' / '.join(tail)}")
    return seconds


def bench_ttfi(
    model_dir: Any,
    *,
    height: int,
    width: int,
    steps: int,
    guidance: float,
    reps: int,
    dtype: str,
    diffusers: bool,
) -> dict[str, Any]:
    """Time to first image, process start to PNG on disk, each run a fresh process.

    Ours cold (no stored XLA programs: an empty persistent cache and executable store each
    run) and warm (both filled by a first run); with `diffusers`, the same image through
    diffusers' pipeline, torch threads = 2."""
    import tempfile

    from flux2klein_cli.core.hub.layout import Snapshot

    snapshot = Snapshot.open(model_dir)
    prompt = "a red fox in snow"
    work = Path(tempfile.mkdtemp(prefix="flux2klein-ttfi-"))
    out = work / "out.png"
    ours = [sys.executable, "-m", "flux2klein_cli", "generate", prompt, "--model", str(model_dir), "-o", str(out),
            "--height", str(height), "--width", str(width), "--steps", str(steps), "--guidance", str(guidance),
            "--dtype", dtype, "--force", "--json"]
    env = settings.child_environment()
    cold = [_timed_process(ours, dict(env, FLUX2KLEIN_XLA_CACHE=str(work / f"cold-{i}"),
                                      FLUX2KLEIN_COMPILE_CACHE=str(work / f"cold-{i}-executables")), out)
            for i in range(reps)]
    warm_env = dict(env, FLUX2KLEIN_XLA_CACHE=str(work / "warm"),
                    FLUX2KLEIN_COMPILE_CACHE=str(work / "warm-executables"))
    _timed_process(ours, warm_env, out)  # fills the cache
    warm = [_timed_process(ours, warm_env, out) for _ in range(reps)]
    result: dict[str, Any] = dict(ours_cold_s=summarize(cold), ours_warm_s=summarize(warm))
    if diffusers:
        code = _DIFFUSERS_TTFI.format(threads=2, cls=snapshot.pipeline_class, model=str(model_dir),
                                      dtype=DTYPES[dtype], prompt=prompt,
                                      height=height, width=width, steps=steps, guidance=guidance, out=str(out))
        ref = [_timed_process([sys.executable, "-c", code], env, out) for _ in range(reps)]
        result["diffusers_s"] = summarize(ref)
        result["cold_ratio"] = result["ours_cold_s"]["median"] / result["diffusers_s"]["median"]
        result["warm_ratio"] = result["ours_warm_s"]["median"] / result["diffusers_s"]["median"]
    return dict(height=height, width=width, steps=steps, dtype=dtype, reps=reps, **result)
