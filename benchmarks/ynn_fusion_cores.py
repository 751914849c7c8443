"""XLA's default YNNPACK fusions against lone dots (core/devices/cpu.py), per core count, in one run.

Each form is a `flux2klein bench --no-store` process pinned to the first N cores with taskset, the
forms in turn, round after round; each figure is the median over rounds. The forms are forced in
the process (core/devices/cpu.py's LONE_DOTS_FROM_CORES), whatever the core count would choose:
  * xla-default: every CPU program compiled with XLA's own YNNPACK fusions;
  * lone-dots: only lone dots go to YNNPACK.
The checkpoint is the "medium" one of /work/shared/docs/benchmarks-method.md (random weights).

    python benchmarks/ynn_fusion_cores.py --cores 3,4,8,13 --rounds 2
    python benchmarks/ynn_fusion_cores.py --cores 1,2 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

# What runs in each bench process before the CLI: the form's threshold, then the CLI itself.
_BENCH = ("import flux2klein_cli.core.devices.cpu as cpu; cpu.LONE_DOTS_FROM_CORES = {threshold}\n"
          "import sys; sys.argv = ['flux2klein'] + sys.argv[1:]\n"
          "from flux2klein_cli.cli.main import console; console()")
FORMS = {"xla-default": 10**6, "lone-dots": 1}


def bench(cores: int, threshold: int, opts: argparse.Namespace) -> float:
    cmd = ["taskset", "-c", f"0-{cores - 1}", sys.executable, "-c", _BENCH.format(threshold=threshold), "bench",
           "--model", str(opts.model), "--height", str(opts.size), "--width", str(opts.size), "--steps",
           str(opts.steps), "--reps", str(opts.reps), "--dtype", opts.dtype, "--no-store", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " / ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"bench on {cores} cores exited {done.returncode}: {tail}")
    return float(json.loads(done.stdout)["per_image_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/flux2klein-ynn-cores"))
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: the medium one, built in --out)")
    parser.add_argument("--cores", default="2,4", help="core counts, comma-separated (the first N cores)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2, help="timed calls per process, after the first")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    opts = parser.parse_args()
    if opts.model is None:
        opts.model = opts.out / "medium"
        if not opts.model.is_dir():
            opts.out.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "flux2klein_cli.core.hub.random_checkpoint", str(opts.model),
                            "--preset", "medium"], check=True, capture_output=True)
    counts = [int(c) for c in opts.cores.split(",") if c]
    times: dict[tuple[int, str], list[float]] = {(c, f): [] for c in counts for f in FORMS}
    for _ in range(opts.rounds):
        for cores in counts:
            for form, threshold in FORMS.items():
                seconds = bench(cores, threshold, opts)
                times[cores, form].append(seconds)
                print(json.dumps({"cores": cores, "form": form, "per_image_s": round(seconds, 3)}), file=sys.stderr)
    print(f"{opts.dtype}, {opts.size}x{opts.size}, {opts.steps} steps; per image, median of {opts.rounds} rounds")
    print(f"{'cores':>5} {'xla-default s':>14} {'lone-dots s':>12} {'speedup':>8}")
    rows = []
    for cores in counts:
        default, lone = (statistics.median(times[cores, f]) for f in FORMS)
        rows.append({"cores": cores, "xla_default_s": round(default, 3), "lone_dots_s": round(lone, 3),
                     "runs_s": {f: [round(t, 3) for t in times[cores, f]] for f in FORMS}})
        print(f"{cores:5d} {default:14.3f} {lone:12.3f} {default / lone:8.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
