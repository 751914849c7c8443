"""The measurement behind `bench --phase load`: how fast checkpoints load, against what limits.

For each component of a snapshot (transformer, text_encoder, vae), every timing runs in a
fresh child process, as a user's command would, after the files have been read once (a warm
page cache), median of `reps`:

    safetensors   our loader on the diffusers snapshot (memory-mapped, converted and placed per tensor)
    orbax         our restore from a `flux2klein convert` directory (if one is given or made)
    cat           `cat` of the same files to /dev/null: reading the bytes, the limit on a CPU host
    fill          allocating and writing as many bytes of fresh memory: the other limit on a CPU host,
                  since a loaded model must live somewhere (this VM backs memory lazily, which is slow)
    diffusers     (transformer) `Flux2Transformer2DModel.from_pretrained(torch_dtype=...)` plus touching
                  every page: from_pretrained alone returns before reading anything (the weights are
                  memory-mapped), so that alone would not be a fair comparison

Load times exclude the Python imports (the child times only the load call). Peak memory is the
child's peak resident set during the load minus its resident set before it (`VmHWM` after
resetting it through /proc/self/clear_refs), and its ratio to the component's bytes.

    python -m flux2klein_cli.core.bench_load /tmp/medium --convert --reps 5 --json
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

COMPONENTS = ("transformer", "text_encoder", "vae")
KINDS = ("safetensors", "orbax", "cat", "fill", "diffusers")


def bench_load(
    model_dir: str | Path,
    *,
    converted_dir: str | Path | None = None,
    convert: bool = False,
    components: Sequence[str] | None = None,
    dtype: str = "bf16",
    reps: int = 3,
    kinds: Sequence[str] = KINDS,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Load timings and peak memory per component and per path, with ratios to the limits.

    `model_dir` is a diffusers-layout snapshot (components may be missing: e.g. a transformer
    alone). `converted_dir` is its `flux2klein convert` output; with `convert=True` one is written
    to a temporary directory for the run and removed afterwards."""
    from flux2klein_cli.core.errors import UserInputError

    model_dir = Path(model_dir).expanduser().resolve()
    names = [c for c in (components or COMPONENTS) if (model_dir / c / "config.json").is_file()]
    if not names:
        raise UserInputError(f"{model_dir}: no component folder with a config.json ({', '.join(COMPONENTS)})")
    if reps < 1:
        raise UserInputError("reps must be at least 1")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise UserInputError(f"unknown measurements {sorted(unknown)}: use {', '.join(KINDS)}")
    say = log or (lambda message: None)

    scratch = None
    if "orbax" in kinds and converted_dir is None and convert:
        scratch = Path(tempfile.mkdtemp(prefix="flux2klein-bench-"))
        converted_dir = scratch / "converted"
        say(f"converting {', '.join(names)} to {converted_dir}")
        _convert_components(model_dir, converted_dir, names, dtype)
    try:
        result: dict[str, Any] = {
            "model": str(model_dir),
            "converted": str(converted_dir) if converted_dir else None,
            "dtype": dtype,
            "reps": reps,
            "cpu_count": os.cpu_count(),
            "components": {},
        }
        for name in names:
            result["components"][name] = _bench_component(
                model_dir, Path(converted_dir) if converted_dir else None, name, dtype, reps, kinds, say
            )
        return result
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _convert_components(model_dir: Path, out: Path, names: Sequence[str], dtype: str) -> None:
    import jax.numpy as jnp

    from flux2klein_cli.core.mesh import default_mesh
    from flux2klein_cli.core.weights.loader import _replicate
    from flux2klein_cli.core.weights.orbax_convert import convert_component

    target = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[dtype]
    for name in names:
        convert_component(name, model_dir / name, out / name, target, default_mesh(), _replicate, 256 << 20, None)


def _bench_component(model_dir: Path, converted: Path | None, name: str, dtype: str, reps: int,
                     kinds: Sequence[str], say: Callable[[str], None]) -> dict[str, Any]:
    weights = sorted((model_dir / name).glob("*.safetensors"))
    orbax_files = sorted(p for p in (converted / name).rglob("*") if p.is_file()) if converted else []
    out: dict[str, Any] = {"file_bytes": sum(p.stat().st_size for p in weights)}
    plans: list[tuple[str, list[Path], list[str]]] = []
    if "safetensors" in kinds:
        plans.append(("safetensors", weights, ["safetensors", str(model_dir / name), name, dtype]))
    if "orbax" in kinds and converted is not None:
        plans.append(("orbax", orbax_files, ["orbax", str(converted), name, dtype]))
    if "cat" in kinds:
        plans.append(("cat", weights, []))
    if "diffusers" in kinds and name == "transformer":
        plans.append(("diffusers", weights, ["diffusers", str(model_dir / name), name, dtype]))
    for kind, files, args in plans:
        runs = []
        for rep in range(reps):
            _cat(files)  # warm page cache: every path starts from the same place
            runs.append(_cat_timed(files) if kind == "cat" else _child(args))
            say(f"{name} {kind} rep {rep + 1}/{reps}: {runs[-1]['seconds']:.2f} s")
        out[kind] = _summary(runs)
    if "fill" in kinds:
        nbytes = out.get("safetensors", out.get("orbax", {})).get("bytes") or out["file_bytes"]
        runs = [_child(["fill", str(nbytes)]) for _ in range(reps)]
        out["fill"] = _summary(runs)
    loaded = out.get("safetensors", out.get("orbax", {}))
    out["bytes"] = loaded.get("bytes")
    out["ratios"] = _ratios(out)
    return out


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in runs]
    summary: dict[str, Any] = {"seconds": {"min": float(np.min(seconds)), "median": float(np.median(seconds)),
                                           "n": len(seconds)}}
    if "peak_bytes" in runs[0]:
        summary["peak_bytes"] = max(r["peak_bytes"] for r in runs)
    if "bytes" in runs[0]:
        summary["bytes"] = runs[0]["bytes"]
        if runs[0]["bytes"] and "peak_bytes" in summary:
            summary["peak_ratio"] = round(summary["peak_bytes"] / runs[0]["bytes"], 3)
    return summary


def _ratios(out: dict[str, Any]) -> dict[str, float]:
    """Median over median: how many times slower than each limit or reference."""
    ratios = {}
    for ours in ("safetensors", "orbax"):
        for ref in ("cat", "fill", "diffusers"):
            if ours in out and ref in out:
                ratios[f"{ours}/{ref}"] = round(out[ours]["seconds"]["median"] / out[ref]["seconds"]["median"], 2)
    return ratios


def _cat(files: Sequence[Path]) -> None:
    for path in files:
        with path.open("rb") as f:
            while f.read(64 << 20):
                pass


def _cat_timed(files: Sequence[Path]) -> dict[str, Any]:
    start = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return {"seconds": time.perf_counter() - start}


def _child(args: Sequence[str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "flux2klein_cli.core.bench_load", "--child", *args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench child {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the child process


def _peak_reset() -> int:
    """Reset the peak resident set (Linux) and return the current resident bytes."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    try:
        match = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    except OSError:
        return 0
    return int(match.group(1)) * 1024 if match else 0


def _load_ours(kind: str, directory: str, name: str, dtype: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from flux2klein_cli.core.checkpoint import parameter_stats

    target = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[dtype]
    if kind == "orbax":
        from flux2klein_cli.core.weights.orbax_store import load_component

        def load() -> Any:
            return load_component(name, directory, dtype=target)
    else:
        from flux2klein_cli.core.models.qwen3 import load_qwen3
        from flux2klein_cli.core.models.transformer import load_transformer
        from flux2klein_cli.core.models.vae import load_vae

        loader = {"transformer": load_transformer, "text_encoder": load_qwen3, "vae": load_vae}[name]

        def load() -> Any:
            return loader(directory, dtype=target)

    jax.devices()  # start the backend before timing
    before = _peak_reset()
    start = time.perf_counter()
    module = load()
    jax.block_until_ready(nnx.state(module))
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM") - before
    return {"seconds": seconds, "peak_bytes": peak, "bytes": parameter_stats(module)[1]}


def _load_diffusers(directory: str, dtype: str) -> dict[str, Any]:
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.set_num_threads(os.cpu_count() or 1)
    target = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    before = _peak_reset()
    start = time.perf_counter()
    model = Flux2Transformer2DModel.from_pretrained(directory, torch_dtype=target, low_cpu_mem_usage=True)
    total = 0
    for tensor in model.state_dict().values():
        # One read per 4 KiB page: the mapped weights are really paged in.
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        total += int(flat[::4096].sum())
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_bytes": _status_bytes("VmHWM") - before}


def _fill(nbytes: int) -> dict[str, Any]:
    from flux2klein_cli.core.weights.loader import aligned_empty

    before = _peak_reset()
    start = time.perf_counter()
    buffer = aligned_empty((nbytes,), np.dtype(np.uint8))
    buffer.fill(1)
    return {"seconds": time.perf_counter() - start, "peak_bytes": _status_bytes("VmHWM") - before}


def _child_main(args: Sequence[str]) -> None:
    kind = args[0]
    if kind == "fill":
        result = _fill(int(args[1]))
    elif kind == "diffusers":
        result = _load_diffusers(args[1], args[3])
    else:
        result = _load_ours(kind, args[1], args[2], args[3])
    print(json.dumps(result))


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--child":
        _child_main(argv[1:])
        return
    parser = argparse.ArgumentParser(description="Time loading a checkpoint per component and per path.")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--converted", type=Path, help="Its `flux2klein convert` directory.")
    parser.add_argument("--convert", action="store_true", help="Convert to a temporary directory for the run.")
    parser.add_argument("--components", default=",".join(COMPONENTS))
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = bench_load(args.model_dir, converted_dir=args.converted, convert=args.convert,
                        components=args.components.split(","), dtype=args.dtype, reps=args.reps,
                        kinds=args.kinds.split(","), log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
