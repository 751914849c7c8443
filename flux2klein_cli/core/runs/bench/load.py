"""The measurement behind `bench --phase load`: how fast checkpoints load, against what limits.

For each component of a snapshot (transformer, text_encoder, vae), every timing runs in a
fresh child process, as a user's command would, after the files have been read once (a warm
page cache), min and median of `reps`:

    safetensors   our loader on the diffusers snapshot (memory-mapped, converted and placed per tensor)
    flat          our load of a `flux2klein convert --layout flat` directory (mapped, adopted by JAX)
    orbax         our restore of a `flux2klein convert --layout orbax` directory (chunk files mapped)
    cat           `cat` of the same files to /dev/null: reading the bytes, the limit on a CPU host
    fill          allocating and writing as many bytes of fresh memory: the other limit on a CPU host
                  for a loader that copies, since a loaded model must live somewhere (this VM backs
                  memory lazily, which is slow)
    diffusers     (transformer) `Flux2Transformer2DModel.from_pretrained(torch_dtype=...,
                  low_cpu_mem_usage=True)` plus touching every page

Every load time includes touching one byte of every 4 KiB page of every parameter afterwards
(`touch_seconds` is that part): a memory-mapped load (flat, orbax, and diffusers, whose from_pretrained
returns before reading anything) pays for its pages at first use, so timing the call alone would
flatter it. Python imports are excluded (the child times only the load). Peak memory is the
child's peak resident set during load and touch minus its resident set before (`VmHWM` after
resetting it through /proc/self/clear_refs; mapped file pages count once touched), and its ratio
to the component's bytes. `build_seconds` is the part spent building the abstract model
(`nnx.eval_shape`), a fixed cost per model whatever its bytes. For the converted layouts,
`zero_copy_bytes` counts the parameter bytes whose device buffer lies inside a mapped file of
the layout (all of them, when JAX adopted every view).

`python benchmarks/load.py` runs it with more choices (components, kinds, a cold page cache, a
converted directory kept between runs).
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

from flux2klein_cli.core.choices import LAYOUTS, jax_dtype, torch_dtype

COMPONENTS = ("transformer", "text_encoder", "vae")
KINDS = ("safetensors", "flat", "orbax", "cat", "fill", "diffusers")
LAYOUT_KINDS = LAYOUTS


def load_kinds(note: Callable[[str], None] | None = None) -> tuple[str, ...]:
    """Every measurement this install can make: diffusers' load needs the [parity] extra."""
    from flux2klein_cli.core.extras import PARITY_MODULES, install_command, missing_modules

    if not missing_modules(PARITY_MODULES):
        return KINDS
    if note:
        note(f"not timing diffusers' load: it needs the [parity] extra ({install_command('parity')})")
    return tuple(kind for kind in KINDS if kind != "diffusers")


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
    cold: bool = False,
) -> dict[str, Any]:
    """Load timings and peak memory per component and per path, with ratios to the limits.

    `cold=True` evicts each run's files from the page cache first (posix_fadvise DONTNEED on
    those files only, so nothing else on a shared host is disturbed) instead of reading them once.

    `model_dir` is a diffusers-layout snapshot (components may be missing: e.g. a transformer
    alone). `converted_dir` is its `flux2klein convert` output (timed as its manifest's layout);
    with `convert=True` each layout in `kinds` that has no directory is written to a temporary
    directory for the run and removed afterwards."""
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

    converted: dict[str, Path] = {}
    if converted_dir is not None:
        converted_dir = Path(converted_dir).expanduser().resolve()
        converted[_layout_of(converted_dir, names[0])] = converted_dir
    scratch = None
    missing = [layout for layout in LAYOUT_KINDS if layout in kinds and layout not in converted]
    if convert and missing:
        scratch = Path(tempfile.mkdtemp(prefix="flux2klein-bench-"))
        for layout in missing:
            converted[layout] = scratch / layout
            say(f"converting {', '.join(names)} to {converted[layout]} ({layout})")
            start = time.perf_counter()
            convert_components(model_dir, converted[layout], names, dtype, layout)
            say(f"converted in {time.perf_counter() - start:.1f} s")
    try:
        result: dict[str, Any] = {
            "model": str(model_dir),
            "converted": {layout: str(path) for layout, path in converted.items()},
            "dtype": dtype,
            "reps": reps,
            "page_cache": "cold" if cold else "warm",
            "cpu_count": os.cpu_count(),
            "components": {},
        }
        for name in names:
            result["components"][name] = _bench_component(model_dir, converted, name, dtype, reps, kinds, say, cold)
        return result
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _layout_of(directory: Path, name: str) -> str:
    """The layout of a converted directory: its manifest's, or (a directory written component by
    component, like the one `--convert` makes) the one whose folder is there."""
    from flux2klein_cli.core.errors import UserInputError
    from flux2klein_cli.core.hub.snapshot import CONVERTED_MANIFEST
    from flux2klein_cli.core.weights.converted_manifest import check_converted, component_layout

    if (directory / CONVERTED_MANIFEST).is_file():
        return component_layout(check_converted(directory), name)
    found = [layout for layout in LAYOUT_KINDS if (directory / name / layout).is_dir()]
    if len(found) != 1:
        raise UserInputError(f"{directory}: not a converted directory (no manifest, no {name}/flat or {name}/orbax)")
    return found[0]


def convert_components(model_dir: Path, out: Path, names: Sequence[str], dtype: str, layout: str) -> None:

    from flux2klein_cli.core.devices.mesh import default_mesh
    from flux2klein_cli.core.devices.sharding import replicated_rule
    from flux2klein_cli.core.weights.convert import convert_component

    target = jax_dtype(dtype)
    for name in names:
        convert_component(name, model_dir / name, out / name, target, default_mesh(), replicated_rule, 256 << 20, None,
                          layout=layout)


def _bench_component(model_dir: Path, converted: dict[str, Path], name: str, dtype: str, reps: int,
                     kinds: Sequence[str], say: Callable[[str], None], cold: bool = False) -> dict[str, Any]:
    weights = sorted((model_dir / name).glob("*.safetensors")) + sorted((model_dir / name).glob("*.gguf"))
    out: dict[str, Any] = {"file_bytes": sum(p.stat().st_size for p in weights)}
    plans: list[tuple[str, list[Path], list[str]]] = []
    if "safetensors" in kinds:
        plans.append(("safetensors", weights, ["safetensors", str(model_dir / name), name, dtype]))
    for layout in LAYOUT_KINDS:
        if layout in kinds and layout in converted:
            files = sorted(p for p in (converted[layout] / name / layout).rglob("*") if p.is_file())
            plans.append((layout, files, [layout, str(converted[layout]), name, dtype]))
    if "cat" in kinds:
        plans.append(("cat", weights, []))
    if "diffusers" in kinds and name == "transformer":
        plans.append(("diffusers", weights, ["diffusers", str(model_dir / name), name, dtype]))
    for kind, files, args in plans:
        runs = []
        for rep in range(reps):
            (_evict if cold else _cat)(files)  # every path starts from the same place
            runs.append(_cat_timed(files) if kind == "cat" else _child(args))
            say(f"{name} {kind} rep {rep + 1}/{reps}: {runs[-1]['seconds']:.2f} s")
        out[kind] = _summary(runs)
    if "fill" in kinds:
        loaded = next((out[k] for k in ("safetensors", *LAYOUT_KINDS) if k in out), {})
        nbytes = loaded.get("bytes") or out["file_bytes"]
        runs = [_child(["fill", str(nbytes)]) for _ in range(reps)]
        out["fill"] = _summary(runs)
    loaded = next((out[k] for k in ("safetensors", *LAYOUT_KINDS) if k in out), {})
    out["bytes"] = loaded.get("bytes")
    out["ratios"] = _ratios(out)
    return out


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for field in ("seconds", "touch_seconds", "build_seconds"):
        if field in runs[0]:
            values = [r[field] for r in runs]
            summary[field] = {"min": float(np.min(values)), "median": float(np.median(values)), "n": len(values)}
    if "peak_bytes" in runs[0]:
        summary["peak_bytes"] = max(r["peak_bytes"] for r in runs)
    for field in ("bytes", "zero_copy_bytes"):
        if field in runs[0]:
            summary[field] = runs[0][field]
    if summary.get("bytes") and "peak_bytes" in summary:
        summary["peak_ratio"] = round(summary["peak_bytes"] / summary["bytes"], 3)
    return summary


def _ratios(out: dict[str, Any]) -> dict[str, float]:
    """How many times slower than each limit or reference: median over median, and min over min
    (on a shared, noisy host the min is the steadier of the two)."""
    ratios = {}
    for ours in ("safetensors", *LAYOUT_KINDS):
        for ref in ("cat", "fill", "diffusers"):
            if ours in out and ref in out:
                for stat in ("median", "min"):
                    ratios[f"{ours}/{ref}" + ("" if stat == "median" else " (min)")] = round(
                        out[ours]["seconds"][stat] / out[ref]["seconds"][stat], 2)
    return ratios


def _cat(files: Sequence[Path]) -> None:
    for path in files:
        with path.open("rb") as f:
            while f.read(64 << 20):
                pass


def _evict(files: Sequence[Path]) -> None:
    """Drop these files' clean pages from the page cache (not other files', unlike drop_caches)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cat_timed(files: Sequence[Path]) -> dict[str, Any]:
    start = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return {"seconds": time.perf_counter() - start}


def _child(args: Sequence[str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "flux2klein_cli.core.runs.bench.load", *args],
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


def _touch(arrays: Sequence[Any]) -> int:
    """Read one byte of every 4 KiB page of each host array (a mapped page is faulted in)."""
    total = 0
    for array in arrays:
        flat = array.reshape(-1).view(np.uint8)
        total += int(flat[::4096].sum())
    return total


def _mapped_ranges(part: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files whose path contains `part`."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and part in fields[-1]:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _load_ours(kind: str, directory: str, name: str, dtype: str) -> dict[str, Any]:
    import jax
    from flax import nnx

    from flux2klein_cli.core.hub.checkpoint import parameter_stats

    target = jax_dtype(dtype)
    if kind in LAYOUT_KINDS:
        from flux2klein_cli.core.weights.converted import load_component

        def load() -> Any:
            return load_component(name, directory, dtype=target, layout=kind)
    else:
        from flux2klein_cli.core.models.qwen3 import load_qwen3
        from flux2klein_cli.core.models.transformer import load_transformer
        from flux2klein_cli.core.models.vae import load_vae

        loader = {"transformer": load_transformer, "text_encoder": load_qwen3, "vae": load_vae}[name]

        def load() -> Any:
            return loader(directory, dtype=target)

    # Time spent building the abstract model (nnx.eval_shape), a fixed cost whatever the bytes.
    eval_shape, built = nnx.eval_shape, [0.0]

    def timed_eval_shape(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return eval_shape(*args, **kwargs)
        finally:
            built[0] += time.perf_counter() - begin

    nnx.eval_shape = timed_eval_shape
    jax.devices()  # start the backend before timing
    before = _peak_reset()
    start = time.perf_counter()
    module = load()
    leaves = jax.tree.leaves(nnx.state(module))
    jax.block_until_ready(leaves)
    loaded = time.perf_counter()
    _touch([np.asarray(leaf) for leaf in leaves])  # host views of the CPU arrays, no copies
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM") - before
    result = {"seconds": seconds, "touch_seconds": seconds - (loaded - start), "build_seconds": built[0],
              "peak_bytes": peak, "bytes": parameter_stats(module)[1]}
    if kind in LAYOUT_KINDS:
        mapped = _mapped_ranges(f"/{name}/{kind}/")  # the flat file, or Orbax's chunk files
        result["zero_copy_bytes"] = sum(leaf.nbytes for leaf in leaves
                                        if any(a <= leaf.unsafe_buffer_pointer() < b for a, b in mapped))
    return result


def _load_diffusers(directory: str, dtype: str) -> dict[str, Any]:
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.set_num_threads(os.cpu_count() or 1)
    target = torch_dtype(dtype)
    before = _peak_reset()
    start = time.perf_counter()
    model = Flux2Transformer2DModel.from_pretrained(directory, torch_dtype=target, low_cpu_mem_usage=True)
    loaded = time.perf_counter()
    # One read per 4 KiB page: the mapped weights are really paged in.
    _touch([tensor.detach().reshape(-1).view(torch.uint8).numpy() for tensor in model.state_dict().values()])
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "touch_seconds": seconds - (loaded - start),
            "peak_bytes": _status_bytes("VmHWM") - before}


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


if __name__ == "__main__":  # one measurement in a fresh process (_child)
    _child_main(sys.argv[1:])
