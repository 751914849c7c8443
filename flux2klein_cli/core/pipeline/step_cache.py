"""Step caching for the base models: the settings, their defaults and checks (no jax here).

Each step the first `blocks` transformer blocks run; the relative mean absolute difference of
their image-stream residual against its value at the row's last full step decides, per image
and CFG branch, whether the remaining blocks run or their residual from that last full step
(TaylorSeer: extrapolated from the last two full steps) is added instead. No step before
`warmup` is cached, nor more than `max_skips` steps in a row. The loop is in denoise.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flux2klein_cli.core.choices import CACHE_MODES
from flux2klein_cli.core.errors import FieldError

# The fields of a request that set a step cache, as RunFields, the PNG metadata and every door name them.
CACHE_FIELDS = ("cache", "cache_threshold", "cache_warmup", "cache_max_skips", "cache_blocks", "cache_taylorseer")


@dataclass(frozen=True)
class CacheForm:
    """What shapes the cached program (part of its key): the blocks that always run, and
    whether the cached residual is extrapolated. The threshold, warm-up and cap are inputs."""

    first_blocks: int
    taylorseer: bool = False

    def as_key(self) -> dict[str, object]:
        return {"first_blocks": self.first_blocks, "taylorseer": self.taylorseer}

    @property
    def suffix(self) -> str:
        """The cached program's name suffix, so its stored entry is its own."""
        return f"_cache_f{self.first_blocks}" + ("_taylor" if self.taylorseer else "")


@dataclass(frozen=True)
class StepCache:
    """A run's step cache settings, resolved (every field set) and checked."""

    mode: str  # "fbcache" (one first block) or "dbcache" (several, optionally TaylorSeer)
    blocks: int  # the first blocks, always run
    threshold: float  # cache a step when the first blocks' residual moved less than this (relative)
    warmup: int  # steps run in full before any is cached (at least 1: a cache needs a full step)
    max_skips: int  # most consecutive cached steps of an image and branch
    taylorseer: bool = False

    @property
    def form(self) -> CacheForm:
        return CacheForm(self.blocks, self.taylorseer)

    @classmethod
    def with_form(cls, form: CacheForm) -> StepCache:
        """Settings of `form` with placeholder numbers: what a program's abstract inputs need."""
        return cls("dbcache", form.first_blocks, 0.0, 1, 0, form.taylorseer)

    def as_metadata(self) -> dict[str, object]:
        """The settings as a run's parameters (PNG text, --json): enough to run it again."""
        return {"cache": self.mode, "cache_threshold": self.threshold, "cache_warmup": self.warmup,
                "cache_max_skips": self.max_skips, "cache_blocks": self.blocks, "cache_taylorseer": self.taylorseer}


# Per mode: blocks, threshold, warm-up, cap. Random-weight checkpoints cannot tell a threshold (their
# steps differ by far more than any trained model's): these follow the published settings for
# trained FLUX models, as docs/benchmarks.md ("Step caching") says.
DEFAULTS: dict[str, dict[str, float | int]] = {
    "fbcache": {"blocks": 1, "threshold": 0.08, "warmup": 8, "max_skips": 3},
    "dbcache": {"blocks": 2, "threshold": 0.08, "warmup": 8, "max_skips": 3},
}


def resolve_cache(mode: str | None, *, double_blocks: int, threshold: float | None = None, warmup: int | None = None,
                  max_skips: int | None = None, blocks: int | None = None, taylorseer: bool | None = None
                  ) -> StepCache | None:
    """The step cache a request asks for (None fields: the mode's defaults), checked against a
    transformer with `double_blocks` double blocks; None for `none` (or no mode). Errors name
    their field.

    The first blocks are double blocks: there the image stream is its own, so its residual is
    the image's alone, and the split leaves the single blocks one scan (a split inside them
    lets XLA reorder a matmul of a one-block scan, so threshold 0 would no longer be the
    uncached loop bit for bit)."""
    mode = "none" if mode is None else mode
    if mode not in CACHE_MODES:
        raise FieldError("cache", f"must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
    if mode == "none":
        given = {"cache_threshold": threshold, "cache_warmup": warmup, "cache_max_skips": max_skips,
                 "cache_blocks": blocks, "cache_taylorseer": taylorseer or None}
        for field, value in given.items():
            if value is not None:
                raise FieldError(field, "needs a step cache: add {field:cache} fbcache or dbcache")
        return None
    defaults = DEFAULTS[mode]
    if mode == "fbcache":
        if blocks not in (None, 1):
            raise FieldError("cache_blocks", "is 1 for fbcache (use {field:cache} dbcache for more first blocks)")
        if taylorseer:
            raise FieldError("cache_taylorseer", "is an option of dbcache, not fbcache")
    cache = StepCache(
        mode=mode, blocks=int(min(defaults["blocks"], double_blocks) if blocks is None else blocks),
        threshold=float(defaults["threshold"] if threshold is None else threshold),
        warmup=int(defaults["warmup"] if warmup is None else warmup),
        max_skips=int(defaults["max_skips"] if max_skips is None else max_skips), taylorseer=bool(taylorseer))
    if not 1 <= cache.blocks <= double_blocks:
        raise FieldError("cache_blocks", f"must lie in 1 .. {double_blocks} (the model's double blocks), "
                                         f"got {cache.blocks}")
    if not cache.threshold >= 0.0 or cache.threshold == float("inf"):
        raise FieldError("cache_threshold", f"must be a finite number >= 0, got {cache.threshold}")
    if cache.warmup < 1:
        raise FieldError("cache_warmup", f"must be at least 1 (the first step fills the cache), got {cache.warmup}")
    if cache.max_skips < 0:
        raise FieldError("cache_max_skips", f"must be at least 0, got {cache.max_skips}")
    return cache


def cache_report(cache: StepCache, cached: Any, difference: Any, branches: int, depth: int) -> dict[str, Any]:
    """What a cached loop skipped, from its per-step, per-row decisions `cached` and measured
    `difference`s (numpy arrays (S, rows); numpy is not imported here: the CLI's help reads this
    module): the rows are `branches` equal groups (the CFG branches), and a branch's remaining
    blocks were skipped at a step when every row of it was cached. With its settings and, per
    step, the largest difference any row measured (None at the first step), to tune the threshold
    by: the run's report."""
    steps, rows = cached.shape
    skipped = cached.reshape(steps, branches, rows // branches).all(axis=2)
    largest = difference.max(axis=1)
    return {
        **cache.as_metadata(),
        "steps": steps,
        "skipped_steps": [int(n) for n in skipped.sum(axis=0)],  # per branch: positive, then negative
        "blocks_skipped": int(skipped.sum()) * (depth - cache.blocks),
        "blocks_total": steps * branches * depth,
        "differences": [round(float(d), 4) if d < float("inf") else None for d in largest],
    }
