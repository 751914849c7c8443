"""What batch and serve add to bench's figure, measured in one process (no drift between
processes): for REPS runs of a BS-plan batch, bench's figure (the sum of the pipeline's phases),
the engine's wall time around them, writing each image as batch does (`write_png`: PNG, fsync,
rename) and encoding it as serve does (PNG + base64). Prints one JSON object.

    python benchmarks/engine_overhead.py --model /tmp/round/medium --size 512 --bs 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--bs", type=int, default=1)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()

    from flux2klein_cli.core.engine.engine import EngineOptions
    from flux2klein_cli.core.engine.opening import Opening
    from flux2klein_cli.core.engine.plan import RunFields, build_plan
    from flux2klein_cli.core.hub.snapshot import resolve_model
    from flux2klein_cli.core.runs.image_files import write_png
    from flux2klein_cli.core.serve.service import encode_png

    # The device batch run_batch makes of BS one-image plans, refused as generate refuses what this host cannot hold.
    batch = RunFields(prompts=("a lighthouse at dawn",), num_images=args.bs, height=args.size, width=args.size)
    opening = Opening(EngineOptions(model=args.model, dtype=args.dtype), resolve_model,
                      lambda facts: build_plan(batch, facts))
    opening.admitted(print)
    engine = opening.load(lambda m: None)

    def plans(rep: int) -> list:
        return [engine.plan(RunFields(prompts=(f"a lighthouse at dawn, study {rep}-{i}",), seed=rep * 100 + i,
                                      height=args.size, width=args.size)) for i in range(args.bs)]

    engine.run_batch(plans(0))  # loads or compiles the shape
    phases, walls, writes, encodes = [], [], [], []
    with tempfile.TemporaryDirectory() as out:
        for rep in range(1, args.reps + 1):
            batch = plans(rep)
            start = time.perf_counter()
            runs = engine.run_batch(batch)
            walls.append(time.perf_counter() - start)
            phases.append(sum(v for k, v in runs[0].seconds.items() if k != "total"))
            start = time.perf_counter()
            for i, run in enumerate(runs):
                write_png(Path(out) / f"{rep}-{i}.png", run.images[0], {"prompt": batch[i].prompts[0]}, force=False)
            writes.append(time.perf_counter() - start)
            start = time.perf_counter()
            for run in runs:
                encode_png(run.images[0])
            encodes.append(time.perf_counter() - start)
    ms = lambda values: round(statistics.median(values) * 1000 / args.bs, 1)  # noqa: E731 (per image)
    print(json.dumps({"size": args.size, "bs": args.bs, "reps": args.reps,
                      "per_image_ms": {"bench_phases": ms(phases), "engine_wall": ms(walls),
                                       "write_png": ms(writes), "encode_png_b64": ms(encodes)}}))


if __name__ == "__main__":
    main()
