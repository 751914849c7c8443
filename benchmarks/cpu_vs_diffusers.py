"""flux2klein against diffusers on this CPU, fp32 and bf16, per image and time to first image, in one run.

Three processes per dtype (torch and XLA in one process slow each other), in turn, round after
round, so a loaded host moves both sides alike; each figure is the median over rounds:
  * ours per image: `flux2klein bench` (steady state: the best of --reps calls after a first);
  * ours time to first image: a whole `flux2klein generate` process, start to PNG on disk, from a
    warm executable store (filled before the first round);
  * diffusers: one process, timed from its start to its first PNG saved (imports, from_pretrained,
    the call, the save: its time to first image), then --reps more calls (its per image: the best),
    torch threads = the CPU count.
The ratios (ours / diffusers) are what the issues' goals name. The checkpoint is the "medium" one of
/work/shared/docs/benchmarks-method.md (random weights, built once).

    python benchmarks/cpu_vs_diffusers.py                            # 512x512, 4 steps, 5 rounds
    python benchmarks/cpu_vs_diffusers.py --rounds 3 --dtypes fp32 --out /tmp/cmp

`--xla-too` adds ours' per image with FLUX2KLEIN_CPU_MATMUL=xla (XLA's own forms, no kernel plugin) in
each round, so a plugin's gain is measured in the same run as the ratios.

`--as-without avx512_bf16` runs both sides as on a CPU without those /proc/cpuinfo flags (AVX-512 without
bf16: Intel Skylake-SP to Ice Lake): ours through benchmarks/cpu_as.py, diffusers with oneDNN held to
that CPU's instructions (ONEDNN_MAX_CPU_ISA; without avx512f, torch's ATen too). The instructions run on
this CPU: it compares the two sides' forms for such a CPU, not that CPU's speed.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "a red fox in snow"
FORMS = ("ours_image", "ours_ttfi", "diffusers")

_DIFFUSERS = """
import time
spawned = float({spawned!r})
import torch, diffusers
torch.set_num_threads({threads})
pipe = diffusers.Flux2KleinPipeline.from_pretrained({model!r}, dtype=getattr(torch, {dtype!r}))
pipe.set_progress_bar_config(disable=True)
def call():
    return pipe(prompt={prompt!r}, height={size}, width={size}, num_inference_steps={steps}, guidance_scale=1.0,
                generator=torch.Generator().manual_seed(0)).images[0]
call().save({out!r})
first = time.time() - spawned
times = []
for _ in range({reps}):
    t = time.perf_counter(); call(); times.append(time.perf_counter() - t)
print(first, min(times))
"""


def run(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{' '.join(args[:5])} ... exit {done.returncode}: {tail}")
    return seconds, done.stdout


def ours(without: str) -> list[str]:
    """How our commands start: the CLI, or the CLI as on a CPU without the flags `without` names."""
    if not without:
        return [sys.executable, "-m", "flux2klein_cli"]
    return [sys.executable, str(Path(__file__).with_name("cpu_as.py")), "--without", without, "--"]


def torch_env(without: str) -> dict[str, str]:
    """oneDNN and ATen held to what a CPU without those flags has."""
    flags = set(without.split(","))
    if "avx512f" in flags:
        return {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    if "avx512_bf16" in flags:
        return {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    return {}


def ours_generate(model: Path, dtype: str, size: int, steps: int, out: Path, without: str = "") -> list[str]:
    return [*ours(without), "generate", PROMPT, "--model", str(model), "-o", str(out),
            "--height", str(size), "--width", str(size), "--steps", str(steps), "--guidance", "1.0",
            "--dtype", dtype, "--force", "--json"]


def one(form: str, dtype: str, opts: argparse.Namespace, env: dict[str, str]) -> dict[str, float]:
    out = opts.out / f"{form}-{dtype}.png"
    if form == "ours_ttfi":
        seconds, _ = run(ours_generate(opts.model, dtype, opts.size, opts.steps, out, opts.as_without), env)
        return {form: seconds}
    if form in ("ours_image", "ours_image_xla"):
        if form == "ours_image_xla":
            env = {**env, "FLUX2KLEIN_CPU_MATMUL": "xla"}
        cmd = [*ours(opts.as_without), "bench", "--model", str(opts.model), "--height", str(opts.size),
               "--width", str(opts.size), "--steps", str(opts.steps), "--reps", str(opts.reps), "--dtype", dtype,
               "--json"]
        _, stdout = run(cmd, env)
        result = json.loads(stdout)
        return {form: float(result["run_s"]["min"]) / int(result["batch"])}  # the best, as diffusers' below
    code = _DIFFUSERS.format(threads=os.cpu_count() or 1, model=str(opts.model),
                             dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype], prompt=PROMPT, size=opts.size,
                             steps=opts.steps, out=str(out), reps=opts.reps, spawned=time.time())
    _, stdout = run([sys.executable, "-c", code], {**env, **torch_env(opts.as_without)})
    ttfi, image = (float(v) for v in stdout.strip().splitlines()[-1].split())
    return {"diffusers_ttfi": ttfi, "diffusers_image": image}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/flux2klein-vs-diffusers"))
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: the medium one, built in --out)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=2, help="timed calls per process, after the first image")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--as-without", default="", help="comma-separated CPU flags both sides run without")
    parser.add_argument("--xla-too", action="store_true", help="also ours per image in XLA's own forms")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    if opts.model is None:
        opts.model = opts.out / "medium"
        if not opts.model.is_dir():
            subprocess.run([sys.executable, "-m", "flux2klein_cli.core.hub.random_checkpoint", str(opts.model),
                            "--preset", "medium"], check=True, capture_output=True)
    env = dict(os.environ, FLUX2KLEIN_COMPILE_CACHE=str(opts.out / "executables"), FLUX2KLEIN_XLA_CACHE="off")
    # Our modules' bytecode, as `pip install` writes it for both sides' site-packages: from a source
    # checkout under PYTHONDONTWRITEBYTECODE (this project's VMs), each process of ours otherwise
    # compiled about 60 of our modules again while diffusers' came compiled.
    import flux2klein_cli

    compileall.compile_dir(Path(flux2klein_cli.__file__).parent, quiet=1)
    dtypes = [d for d in opts.dtypes.split(",") if d]
    for dtype in dtypes:  # fills the store: every later process of ours starts warm
        run(ours_generate(opts.model, dtype, opts.size, opts.steps, opts.out / "warm.png", opts.as_without), env)
    forms = (*FORMS, "ours_image_xla") if opts.xla_too else FORMS
    names = ("ours_image", "ours_ttfi", "diffusers_image", "diffusers_ttfi", "ours_image_xla")
    times: dict[tuple[str, str], list[float]] = {(d, f): [] for d in dtypes for f in names}
    for _ in range(opts.rounds):
        for dtype in dtypes:
            for form in forms:
                for name, seconds in one(form, dtype, opts, env).items():
                    times[dtype, name].append(seconds)
                    print(json.dumps({"dtype": dtype, name: round(seconds, 3)}), file=sys.stderr)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"cpu: {cpu}, {os.cpu_count()} CPUs" + (f", run as without {opts.as_without}" if opts.as_without else "")
          + f"; {opts.size}x{opts.size}, {opts.steps} steps; median of {opts.rounds} rounds, forms interleaved")
    print(f"{'dtype':6} {'form':16} {'ours s':>8} {'diffusers s':>12} {'ratio':>7}")
    rows = []
    for dtype in dtypes:
        med = {f: statistics.median(times[dtype, f]) for f in names if times[dtype, f]}
        for what in ("image", "ttfi", "image_xla")[: 3 if opts.xla_too else 2]:
            ours, theirs = med[f"ours_{what}"], med[f"diffusers_{what.removesuffix('_xla')}"]
            rows.append({"dtype": dtype, "form": what, "ours_s": round(ours, 3), "diffusers_s": round(theirs, 3),
                         "ratio": round(ours / theirs, 3),
                         "runs_s": {f: [round(t, 3) for t in times[dtype, f]]
                                    for f in (f"ours_{what}", f"diffusers_{what.removesuffix('_xla')}")}})
            print(f"{dtype:6} {what:16} {ours:8.3f} {theirs:12.3f} {ours / theirs:7.3f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
