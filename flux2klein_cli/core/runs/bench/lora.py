"""The measurement behind `bench --phase lora`: loading the transformer plain and with a random
LoRA of each rank on every linear module (ai-toolkit / BFL layout), merged at load.

All loads run in one process after one untimed load (page cache warm), the forms interleaved rep
by rep (plain, rank a, rank b, plain, ...) so a busy host slows each alike. The LoRA files are
written to a temporary folder in the flux2klein cache and removed afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flux2klein_cli.core.errors import FieldError, UserInputError


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        ranks = []
    if not ranks or any(r < 1 for r in ranks):
        raise FieldError("ranks", f"{text}: give positive integers separated by commas, e.g. 16,64")
    return ranks


def _timed(transformer: Path, dtype: Any, specs: list[Any]) -> float:
    import jax
    from flax import nnx

    from flux2klein_cli.core.lora.merge import LoraDeltas
    from flux2klein_cli.core.models.transformer import load_transformer

    start = time.perf_counter()
    model = load_transformer(transformer, dtype=dtype, deltas=LoraDeltas.read(specs))
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - start
    del model
    return seconds


def bench_lora(model_dir: Path, *, ranks: Sequence[int], dtype: str, reps: int,
               log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Seconds to load `model_dir`'s transformer plain and with a rank-r LoRA for each of `ranks`."""
    from flux2klein_cli.core.cache_paths import cache_root
    from flux2klein_cli.core.choices import jax_dtype
    from flux2klein_cli.core.lora.files import LoraSpec
    from flux2klein_cli.core.lora.random_lora import write_random_lora
    from flux2klein_cli.core.runs.bench.stats import summarize
    from flux2klein_cli.core.temporaries import temporary_dir

    transformer = Path(model_dir) / "transformer"
    if not transformer.is_dir():
        raise UserInputError(f"{model_dir}: no transformer/ folder to load")
    target = jax_dtype(dtype)
    parent = cache_root()
    parent.mkdir(parents=True, exist_ok=True)
    with temporary_dir(parent, "bench-lora") as folder:
        forms: dict[str, list[Any]] = {"plain": []}
        sizes: dict[str, float] = {}
        for rank in ranks:
            path = write_random_lora(folder / f"rank{rank}.safetensors", transformer, "bfl", rank=rank, alpha=rank)
            forms[f"rank{rank}"] = [LoraSpec(str(path))]
            sizes[f"rank{rank}"] = path.stat().st_size / 1e6
        _timed(transformer, target, [])  # warm the page cache
        seconds: dict[str, list[float]] = {form: [] for form in forms}
        for rep in range(reps):
            for form, specs in forms.items():
                seconds[form].append(_timed(transformer, target, specs))
                if log:
                    log(f"rep {rep + 1}/{reps} {form}: {seconds[form][-1]:.2f} s")
    plain = summarize(seconds["plain"])
    result: dict[str, Any] = {"model": str(model_dir), "dtype": dtype, "reps": reps, "forms": {}}
    for form, samples in seconds.items():
        entry: dict[str, Any] = {"seconds": summarize(samples)}
        if form != "plain":
            entry["file_mb"] = round(sizes[form], 1)
            entry["extra_s"] = {k: entry["seconds"][k] - plain[k] for k in ("min", "median")}
        result["forms"][form] = entry
    return result
