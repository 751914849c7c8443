"""Quantized transformer files against bf16 on the medium geometry: load time, peak memory, bytes held, per-image time.

    python benchmarks/quantized_files.py MEDIUM_DIR OUT_DIR [--rounds 5] [--size 256] [--steps 4]

Writes, from MEDIUM_DIR's transformer, the files users have (tests/fixtures/quantized_files.py: GGUF BF16,
Q8_0 and Q4_K, and a ComfyUI fp8 file), then measures each through `--transformer FILE`, the variants
interleaved round by round (A/B/C/D, then rotated), each measurement a fresh process:

- load: `python -m flux2klein_cli.core.runs.bench.load` on the composed model's transformer (bf16), warm
  page cache: seconds, peak resident memory over the process's start, and the bytes the model holds;
- per image: `flux2klein bench` (pipeline phase, bf16, --reps 3): its per_image_s.

Prints one JSON object: per variant the medians over the rounds, and ratios to bf16. Run beside other
work only as ratios (docs/benchmarks-method.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.fixtures: the writers the tests use


def write_files(medium: Path, out: Path) -> dict[str, Path]:
    from tests.fixtures.quantized_files import write_comfy, write_gguf

    out.mkdir(parents=True, exist_ok=True)
    files = {kind.lower(): out / f"medium-{kind}.gguf" for kind in ("BF16", "Q8_0", "Q4_K")}
    for kind, path in files.items():
        if not path.exists():
            write_gguf(medium, path, kind.upper())
    files["fp8"] = out / "medium-fp8.safetensors"
    if not files["fp8"].exists():
        write_comfy(medium, files["fp8"], "float8_e4m3fn")
    return files


def run_json(command: list[str]) -> dict:
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=os.environ.copy())
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("medium", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    from flux2klein_cli.core.hub.components import resolve_composed

    files = write_files(args.medium, args.out)
    composed = {name: resolve_composed(str(args.medium), str(path)) for name, path in files.items()}
    names = list(files)
    load: dict[str, list[dict]] = {name: [] for name in names}
    image: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            result = run_json([sys.executable, "-m", "flux2klein_cli.core.runs.bench.load", str(composed[name]),
                               "--components", "transformer", "--kinds", "safetensors", "--reps", "1",
                               "--dtype", "bf16", "--json"])
            load[name].append(result["components"]["transformer"]["safetensors"])
        for name in order:
            result = run_json([sys.executable, "-m", "flux2klein_cli", "bench", "--model", str(args.medium),
                               "--transformer", str(files[name]), "--height", str(args.size), "--width", str(args.size),
                               "--steps", str(args.steps), "--dtype", "bf16", "--reps", "3", "--json"])
            image[name].append(result["per_image_s"])
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    summary = {}
    for name in names:
        summary[name] = {
            "file_bytes": files[name].stat().st_size,
            "load_s": statistics.median(r["seconds"]["median"] for r in load[name]),
            "peak_bytes": statistics.median(r["peak_bytes"] for r in load[name]),
            "held_bytes": load[name][0]["bytes"],
            "per_image_s": statistics.median(image[name]),
        }
    base = summary["bf16"]
    for values in summary.values():
        values["ratios_to_bf16"] = {key: round(values[key] / base[key], 3)
                                    for key in ("file_bytes", "load_s", "peak_bytes", "held_bytes", "per_image_s")}
    print(json.dumps({"rounds": args.rounds, "size": args.size, "steps": args.steps, "variants": summary}, indent=1))


if __name__ == "__main__":
    main()
