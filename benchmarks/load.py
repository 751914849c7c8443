"""How fast checkpoints load, per component and per path, against what limits: the measurement
behind `flux2klein bench --phase load` (flux2klein_cli/core/runs/bench/load.py) with every choice
it has, and a converted directory written once and kept for repeated runs.

    python benchmarks/load.py /tmp/medium --convert --reps 5 --json
    python benchmarks/load.py /tmp/4b --components transformer --convert-to /tmp/4b-flat --layout flat
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from flux2klein_cli.core.runs.bench.load import COMPONENTS, KINDS, LAYOUT_KINDS, bench_load, convert_components


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Time loading a checkpoint per component and per path.")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--converted", type=Path,
                        help="Its `flux2klein convert` directory (or one written by --convert-to).")
    parser.add_argument("--convert-to", type=Path, metavar="DIR",
                        help="Write the components in --layout to DIR (kept) and exit: for repeated runs.")
    parser.add_argument("--layout", default="flat", choices=LAYOUT_KINDS, help="Layout for --convert-to.")
    parser.add_argument("--convert", action="store_true", help="Convert to a temporary directory for the run.")
    parser.add_argument("--components", default=",".join(COMPONENTS))
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--cold", action="store_true", help="Evict the files from the page cache before each run.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.convert_to:
        start = time.perf_counter()
        convert_components(args.model_dir.expanduser().resolve(), args.convert_to.expanduser().absolute(),
                           [c for c in args.components.split(",") if (args.model_dir / c / "config.json").is_file()],
                           args.dtype, args.layout)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        print(json.dumps({"converted": str(args.convert_to), "layout": args.layout,
                          "seconds": round(time.perf_counter() - start, 2), "peak_rss_bytes": peak}))
        return
    result = bench_load(args.model_dir, converted_dir=args.converted, convert=args.convert,
                        components=args.components.split(","), dtype=args.dtype, reps=args.reps,
                        kinds=args.kinds.split(","), log=lambda m: print(m, file=sys.stderr, flush=True),
                        cold=args.cold)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
