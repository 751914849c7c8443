"""The record of a batch: `DIR/results.jsonl` (or one file per shard), resume, `--merge`.

One JSON object per finished item, appended, flushed and fsynced as each device batch ends:
`index`, `line`, `status` (ok / error), `outputs` (names inside DIR), `seed` and `seeds`,
`seconds` (the batch's, shared by its items), `error`, `hash` (the request's, see
grouping.digest) and `files` (each output's size and sha256). A line cut short by a kill is
ignored on reading. An item is done when some results file in DIR records it ok with its
current hash and every file it names is there with the recorded size and sha256; anything
else is (re)done.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flux2klein_cli.core.errors import Flux2KleinError, UserInputError
from flux2klein_cli.core.runs.batch.grouping import Item, Shard

RESULTS = "results.jsonl"
_SHARD_FILE = re.compile(r"results-shard-(\d+)-of-(\d+)\.jsonl")


def results_name(shard: Shard | None) -> str:
    return RESULTS if shard is None else f"results-shard-{shard.index}-of-{shard.count}.jsonl"


@dataclass
class Record:
    index: int
    line: int
    status: str  # ok / error
    outputs: list[str]
    seed: int | None
    seeds: list[int]
    seconds: float
    error: str | None
    hash: str
    files: list[dict[str, Any]] = field(default_factory=list)  # {"name", "bytes", "sha256"} per output

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, obj: Any) -> Record | None:
        """A record read back, or None for anything that is not one (a torn or foreign line)."""
        if not isinstance(obj, dict):
            return None
        try:
            record = cls(**{name: obj[name] for name in cls.__dataclass_fields__ if name in obj})
        except TypeError:
            return None
        if not isinstance(record.index, int) or not isinstance(record.files, list):
            return None
        return record


def file_facts(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return {"name": None, "bytes": size, "sha256": digest.hexdigest()}


def ok_record(item: Item, out_dir: Path, seconds: float) -> Record:
    files = [dict(file_facts(out_dir / name), name=name) for name in item.outputs]
    return Record(item.index, item.entry.line, "ok", list(item.outputs), item.seeds[0], list(item.seeds),
                  round(seconds, 4), None, item.digest, files)


def error_record(item: Item, message: str, seconds: float) -> Record:
    return Record(item.index, item.entry.line, "error", [], item.seeds[0], list(item.seeds), round(seconds, 4),
                  message, item.digest)


def read_records(path: Path) -> Iterator[Record]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return
    except OSError as e:
        raise UserInputError(f"cannot read results file {path}: {e.strerror or e}") from None
    for line in lines:
        try:
            record = Record.of(json.loads(line))
        except json.JSONDecodeError:
            continue
        if record is not None:
            yield record


def results_files(out_dir: Path) -> list[Path]:
    """results.jsonl first, then every shard's file, in a fixed order."""
    if not out_dir.is_dir():
        return []
    shards = sorted((p for p in out_dir.iterdir() if _SHARD_FILE.fullmatch(p.name)),
                    key=lambda p: tuple(int(g) for g in _SHARD_FILE.fullmatch(p.name).groups()[::-1]))  # type: ignore[union-attr]
    whole = out_dir / RESULTS
    return ([whole] if whole.is_file() else []) + shards


def _matches(record: Record, out_dir: Path) -> bool:
    if record.status != "ok" or len(record.files) != len(record.outputs):
        return False
    for info in record.files:
        try:
            path = out_dir / str(info["name"])
            if not path.is_file() or path.stat().st_size != info["bytes"]:
                return False
            if file_facts(path)["sha256"] != info["sha256"]:
                return False
        except (KeyError, TypeError, OSError):
            return False
    return True


def done_items(items: Iterable[Item], out_dir: Path) -> set[int]:
    """Indexes of the items recorded ok under their current hash, whose files are there and match."""
    wanted = {item.index: item for item in items}
    candidates: dict[int, list[Record]] = {}
    for path in results_files(out_dir):
        for record in read_records(path):
            item = wanted.get(record.index)
            if item is not None and record.hash == item.digest and record.outputs == list(item.outputs):
                candidates.setdefault(record.index, []).append(record)
    return {index for index, records in candidates.items() if any(_matches(r, out_dir) for r in records)}


class ResultsFile:
    """The run's results file, opened for appending; each `append` is durable when it returns."""

    def __init__(self, path: Path):
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        except OSError as e:
            raise UserInputError(f"cannot write results file {path}: {e.strerror or e}") from None
        if self._file.tell() > 0:  # a line cut short by a kill ends here, so the next one starts clean
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._file.write("\n")

    def append(self, records: Sequence[Record]) -> None:
        try:
            for record in records:
                self._file.write(json.dumps(record.as_dict(), ensure_ascii=False) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            raise Flux2KleinError(f"could not write results file {self.path}: {e.strerror or e}") from e

    def close(self) -> None:
        self._file.close()


@dataclass
class MergeReport:
    """What `batch --merge DIR` joined into DIR/results.jsonl."""

    results: str
    files: list[str]
    items: int
    ok: int
    failed: int
    missing_shards: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def merge_results(out_dir: Path) -> MergeReport:
    """Every results file of DIR as one results.jsonl: per item the last ok record whose files
    match (else its last record), in index order; written atomically. The shard files stay."""
    from flux2klein_cli.core.temporaries import temporary_file

    if not out_dir.is_dir():
        raise UserInputError(f"{out_dir} is not a directory")
    files = results_files(out_dir)
    if not files:
        raise UserInputError(f"{out_dir} holds no results files ({RESULTS} or results-shard-I-of-N.jsonl)")
    best: dict[int, Record] = {}
    for path in files:
        for record in read_records(path):
            current = best.get(record.index)
            if current is None or not (current.status == "ok" and record.status != "ok"):
                best[record.index] = record
    for index, record in list(best.items()):
        if record.status == "ok" and not _matches(record, out_dir):
            best[index] = Record(**dict(record.as_dict(), status="error", error="its files are missing or changed"))
    counts: dict[int, set[int]] = {}
    for path in files:
        match = _SHARD_FILE.fullmatch(path.name)
        if match:
            counts.setdefault(int(match[2]), set()).add(int(match[1]))
    missing = [f"{i}/{n}" for n, seen in sorted(counts.items()) for i in range(n) if i not in seen]
    target = out_dir / RESULTS
    try:
        with temporary_file(out_dir, RESULTS) as (fd, tmp):
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for index in sorted(best):
                    f.write(json.dumps(best[index].as_dict(), ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
    except OSError as e:
        raise Flux2KleinError(f"could not write {target}: {e.strerror or e}") from e
    ok = sum(r.status == "ok" for r in best.values())
    return MergeReport(str(target), [p.name for p in files], len(best), ok, len(best) - ok, missing)
