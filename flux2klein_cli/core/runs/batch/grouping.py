"""Valid entries as planned items, their output names, device batches of one batch key, shards.

Order is a pure function of the manifest and the options, so every run (a rerun, each shard of
a split) sees the same batches: batch keys in order of first appearance, items in manifest
order within a key, packed greedily into batches of at most `batch_size` images (an item is
never split; one bigger than the batch size runs alone). Each key's batches run back to back,
so its programs are compiled (or loaded) once. A shard takes every N-th batch of that order;
its part still runs key after key.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path, PurePath
from typing import Any

from flux2klein_cli.core import limits
from flux2klein_cli.core.engine.cost import Demand
from flux2klein_cli.core.engine.plan import ModelFacts, RunFields, RunPlan, build_plan
from flux2klein_cli.core.errors import FieldError, Flux2KleinError, UserInputError
from flux2klein_cli.core.fields import manifest_key
from flux2klein_cli.core.runs.batch.manifest import Entry
from flux2klein_cli.core.runs.outputs import render_outputs


@dataclass(frozen=True)
class Item:
    """A valid entry: what it asks for, resolved, and where its images go."""

    entry: Entry
    key: tuple[Any, ...]  # RunPlan.batch_key()
    seeds: tuple[int, ...]
    outputs: tuple[str, ...]  # relative to the output directory, one per image
    digest: str  # the request's hash: a changed line (or a changed default) is a new request
    # What its run asks of the host (core/engine/cost.py), checked before loading.
    demand: Demand = field(compare=False, repr=False)

    @property
    def index(self) -> int:
        return self.entry.index

    @property
    def images(self) -> int:
        return len(self.seeds)


@dataclass(frozen=True)
class Batch:
    items: tuple[Item, ...]

    @property
    def images(self) -> int:
        return sum(item.images for item in self.items)


def field_message(error: Flux2KleinError) -> str:
    """An error in the manifest's words (`images`, not `references`)."""
    return error.named(manifest_key)


def plan_entry(entry: Entry, facts: ModelFacts) -> list[RunPlan]:
    """The entry's plans (every check of build_plan), one per image: a batch then holds images of
    any item of its key, whatever its image count; each image keeps its own seed."""
    assert entry.fields is not None
    plan = build_plan(entry.fields, facts)
    seeds = entry.seeds if entry.seeds is not None else plan.seeds
    return [replace(plan, seeds=(seed,), num_images=1) for seed in seeds]


def input_files(fields: RunFields | None) -> dict[str, str]:
    """sha256 of each file a request reads (references, init image, mask), by path: a file
    changed in place is a new request though its line is not."""
    if fields is None:
        return {}
    paths = [*fields.references, fields.init_image, fields.mask]
    out: dict[str, str] = {}
    for path in paths:
        if isinstance(path, PurePath) and str(path) not in out:
            try:
                out[str(path)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            except OSError:
                out[str(path)] = "unreadable"  # planning already refused it; the run will again
    return out


def digest(entry: Entry, seeds: Sequence[int], outputs: Sequence[str], engine: dict[str, Any]) -> str:
    """sha256 of everything that decides the item's images and names: the line's fields with
    the defaults applied, the content of the files they name, its seeds and outputs, and the
    engine (model, dtype, LoRAs)."""
    fields = asdict(entry.fields) if entry.fields is not None else {}
    record = dict(fields=fields, files=input_files(entry.fields), seeds=list(seeds), outputs=list(outputs),
                  engine=engine)
    text = json.dumps(record, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def plan_items(entries: Sequence[Entry], facts: ModelFacts, engine: dict[str, Any]) -> tuple[list[Item], list[Entry]]:
    """(valid items, bad entries): every entry planned against the model, its outputs named,
    names colliding with an earlier item's refused. Entries already bad stay bad."""
    items: list[Item] = []
    bad: list[Entry] = []
    taken: dict[str, int] = {}
    for entry in entries:
        if not entry.ok:
            bad.append(entry)
            continue
        try:
            plans = plan_entry(entry, facts)
            plan, seeds = plans[0], tuple(p.seeds[0] for p in plans)
            outputs = render_outputs(entry.output, entry.index, seeds, plan.prompts[0])
            for name in outputs:
                other = taken.get(name.lower())
                if other is not None:
                    raise UserInputError(f"output {name} is also line {other}'s")
        except UserInputError as e:
            bad.append(replace(entry, error=field_message(e)))
            continue
        for name in outputs:
            taken[name.lower()] = entry.line
        items.append(Item(entry, plan.batch_key(), seeds, outputs, digest(entry, seeds, outputs, engine),
                          Demand(plan, batch=len(plans))))
    return items, bad


def group_batches(items: Sequence[Item], batch_size: int) -> list[Batch]:
    """Every item in batches: keys in order of first appearance, items in order within a key."""
    limits.check_int("batch_size", batch_size, 1, limits.LIMITS.images)
    by_key: dict[tuple[Any, ...], list[Item]] = {}
    for item in items:
        by_key.setdefault(item.key, []).append(item)
    batches: list[Batch] = []
    for group in by_key.values():
        current: list[Item] = []
        for item in group:
            if current and sum(i.images for i in current) + item.images > batch_size:
                batches.append(Batch(tuple(current)))
                current = []
            current.append(item)
        if current:
            batches.append(Batch(tuple(current)))
    return batches


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """`I/N`: shard I (from 0) of N."""
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not match:
            raise FieldError("shard", f"must be I/N (shard I of N, I from 0), got {text!r}")
        index, count = int(match[1]), int(match[2])
        if count < 1 or index >= count:
            raise FieldError("shard", f"must have 0 <= I < N, got {index}/{count}")
        return cls(index, count)

    def take(self, batches: Sequence[Batch]) -> list[Batch]:
        return list(batches[self.index::self.count])

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"
