"""The batch loop: manifest -> items -> batches (this shard's) -> engine -> PNGs and records.

Every line is checked before the model loads. The engine opens only when something is left to
do, and each device batch is recorded once its PNGs are written, so a rerun after any stop
skips exactly what was finished. While the loop runs, the first SIGINT / SIGTERM lets the
current batch finish and be recorded, then the run stops (`BatchReport.interrupted`); a second
one abandons it at once (exit 130, temporaries removed, nothing recorded for that batch).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flux2klein_cli.core.engine.cost import Admission, Demand
from flux2klein_cli.core.engine.engine import Engine, EngineOptions
from flux2klein_cli.core.engine.opening import Opening
from flux2klein_cli.core.engine.plan import ModelFacts, RunFields, RunPlan
from flux2klein_cli.core.errors import Flux2KleinError, UserInputError
from flux2klein_cli.core.runs.batch import grouping, results
from flux2klein_cli.core.runs.batch.grouping import Batch, Item, Shard
from flux2klein_cli.core.runs.batch.manifest import DEFAULT_OUTPUT, Entry, read_manifest
from flux2klein_cli.core.runs.outputs import refuse_existing

Warn = Callable[[str], None]
Progress = Callable[[int, int, int], None]  # (items finished, items to run, images written)
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class BatchOptions:
    """A `batch` run: the engine, the manifest and the defaults its lines fall back on, where it all goes."""

    engine: EngineOptions
    manifest: Path
    out_dir: Path
    defaults: RunFields = field(default_factory=lambda: RunFields(prompts=()))  # prompts come from the lines
    output: str = DEFAULT_OUTPUT  # name template of lines without `output`
    batch_size: int = 1  # images per device batch
    shard: Shard | None = None
    strict: bool = False  # a bad line stops the run before anything runs
    force: bool = False  # overwrite files at output names that no results file records
    format: str | None = None  # jsonl / csv / text [default: from the suffix, then the first line]


@dataclass
class BatchReport:
    """What `batch` did: `--json` prints `as_dict()`."""

    manifest: str
    format: str
    out_dir: str
    results: str
    shard: str | None
    model: str
    items: int  # valid items in this run's part (its shard's)
    ok: int  # done by this run
    skipped: int  # done before (recorded, files match)
    failed: int  # error records this run wrote
    bad_lines: list[dict[str, Any]]  # {"line", "index", "error"}: skipped, never run
    batches: int
    images: int
    images_per_second: float
    programs_compiled: int
    programs_loaded: int
    interrupted: bool
    seconds: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return 1 if self.failed or self.bad_lines else 0


def engine_identity(options: EngineOptions) -> dict[str, Any]:
    """What of the engine decides an item's images (a part of each item's hash)."""
    return dict(model=options.model, dtype=options.dtype, lora=list(options.lora), **options.components)


def bad_line(entry: Entry) -> dict[str, Any]:
    return {"line": entry.line, "index": entry.index, "error": entry.error}


def check_outputs(opts: BatchOptions, items: Sequence[Item]) -> None:
    """A directory without results files is not a batch's yet: a file at a pending item's output
    name there is someone else's, refused unless `force`. Once DIR holds results, it is the
    batch's, and an item not done is written again over whatever its names hold."""
    if opts.force or results.results_files(opts.out_dir):
        return
    for item in items:
        refuse_existing((opts.out_dir / name for name in item.outputs),
                        f" and no results file in {opts.out_dir} records it")


@dataclass
class _Prepared:
    items: list[Item]
    bad: list[Entry]
    batches: list[Batch]  # this shard's, in run order


def _prepare(opts: BatchOptions, entries: Sequence[Entry], facts: ModelFacts) -> _Prepared:
    items, bad = grouping.plan_items(entries, facts, engine_identity(opts.engine))
    batches = grouping.group_batches(items, opts.batch_size)
    if opts.shard is not None:
        batches = opts.shard.take(batches)
    return _Prepared(items, bad, batches)


def _refused(batches: Sequence[Batch], admission: Admission) -> list[results.Record]:
    """Error records of the items this host cannot hold, refused as generate refuses them."""
    refused = []
    for batch in batches:
        for item in batch.items:
            try:
                admission.check(item.demand)
            except UserInputError as e:
                refused.append(results.error_record(item, grouping.field_message(e), 0.0))
    return refused


def check_device_batches(batches: Sequence[Batch], admission: Admission) -> None:
    """Each device batch as the engine will run it (its items' images together, up to --bs) fits
    this host, else the run is refused before anything loads or is recorded (`batch_size`)."""
    for batch in batches:
        if len(batch.items) > 1:
            admission.check(Demand(batch.items[0].demand, batch=batch.images), images="batch_size")


def _record(path: Path, records: Sequence[results.Record]) -> None:
    file = results.ResultsFile(path)
    try:
        file.append(records)
    finally:
        file.close()


def _pending(batches: Sequence[Batch], done: set[int]) -> list[Batch]:
    left = [Batch(tuple(i for i in b.items if i.index not in done)) for b in batches]
    return [b for b in left if b.items]


class StopRequest:
    """Set by the first signal while the loop runs."""

    def __init__(self) -> None:
        self.requested = False


@contextmanager
def graceful_stop(note: Warn) -> Iterator[StopRequest]:
    """Within the block, SIGINT / SIGTERM no longer interrupt: the first sets `.requested` (the
    loop stops after its batch), the second ends the process at once (exit 130) from a thread,
    which runs even while the main thread is inside a device call. Outside the main thread,
    nothing changes."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    from flux2klein_cli.core.temporaries import remove_live

    signals = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) != signal.SIG_IGN]
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch() -> None:
        seen = 0
        while True:
            select.select([read_fd], [], [])
            for signum in os.read(read_fd, 64):
                if signum == 0:  # the block ended
                    return
                if signum not in signals:
                    continue
                seen += 1
                if seen == 1:
                    stop.requested = True
                    note("stopping after the current batch (signal again to abandon it)")
                else:
                    remove_live()
                    with _quietly():
                        sys.stderr.write("interrupted\n")
                        sys.stderr.flush()
                    os._exit(EXIT_INTERRUPTED)

    def handler(signum: int, frame: object) -> None:
        stop.requested = True  # the watcher counts; this only keeps the signal from interrupting

    previous = {s: signal.getsignal(s) for s in signals}
    old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="flux2klein-batch-stop", daemon=True)
    watcher.start()
    for s in signals:
        signal.signal(s, handler)
    try:
        yield stop
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
        signal.set_wakeup_fd(old_wakeup, warn_on_full_buffer=False)
        os.write(write_fd, b"\0")
        watcher.join(timeout=5)
        os.close(write_fd)
        os.close(read_fd)


@contextmanager
def _quietly() -> Iterator[None]:
    try:
        yield
    except (OSError, ValueError):
        pass


def run_batch(
    opts: BatchOptions,
    resolve: Callable[[str], Path],
    on_phase: Callable[[str], None] = lambda phase: None,
    warn: Warn = lambda message: print(f"warning: {message}", file=sys.stderr),
    on_progress: Progress | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> BatchReport:
    """Validate every line, skip what is done, run the rest batch by batch, record each batch."""
    from flux2klein_cli.core.devices.distributed import is_writer
    from flux2klein_cli.core.paths import check_name_length

    start = time.perf_counter()
    check_name_length(opts.out_dir, "out_dir")
    if opts.out_dir.exists() and not opts.out_dir.is_dir():
        raise UserInputError(f"output directory {opts.out_dir} is not a directory")
    on_phase("reading manifest")
    manifest = read_manifest(opts.manifest, opts.defaults, output=opts.output, format=opts.format)

    def prepare(facts: ModelFacts) -> _Prepared:
        on_phase("checking manifest lines")
        return _prepare(opts, manifest.entries, facts)

    opening = Opening(opts.engine, resolve, prepare, on_phase=on_phase)
    prepared = opening.planned
    if opts.strict and prepared.bad:
        first = prepared.bad[0]
        more = f" (and {len(prepared.bad) - 1} more bad lines)" if len(prepared.bad) > 1 else ""
        raise UserInputError(f"manifest {opts.manifest} line {first.line}: {first.error}{more}")
    for entry in prepared.bad:
        warn(f"manifest line {entry.line}: {entry.error}; skipped")
    if not prepared.items:
        raise UserInputError(f"manifest {opts.manifest} has no usable lines")

    shard_items = [i for b in prepared.batches for i in b.items]
    done = results.done_items(shard_items, opts.out_dir)
    pending = _pending(prepared.batches, done)
    check_outputs(opts, [i for b in pending for i in b.items])
    results_path = opts.out_dir / results.results_name(opts.shard)
    report = BatchReport(
        manifest=str(opts.manifest), format=manifest.format, out_dir=str(opts.out_dir), results=str(results_path),
        shard=None if opts.shard is None else opts.shard.label, model=opts.engine.model, items=len(shard_items),
        ok=0, skipped=len(done), failed=0, bad_lines=[bad_line(e) for e in prepared.bad], batches=len(pending),
        images=0, images_per_second=0.0, programs_compiled=0, programs_loaded=0, interrupted=False, seconds={})
    if not pending:
        report.seconds = dict(total=round(time.perf_counter() - start, 4))
        return report

    load_start = time.perf_counter()
    admission = opening.resolve()
    if opening.planned is not prepared:  # planned again against the snapshot's facts
        prepared = opening.planned
        pending = _pending(prepared.batches, results.done_items([i for b in prepared.batches for i in b.items],
                                                                opts.out_dir))
    refused = _refused(pending, admission)
    pending = _pending(pending, {r.index for r in refused})
    check_device_batches(pending, admission)
    report.batches, report.failed = len(pending), len(refused)
    writer = is_writer()
    if refused:
        for record in refused:
            warn(f"manifest line {record.line}: {record.error}")
        if writer:
            _record(results_path, refused)
    if not pending:
        report.seconds = dict(total=round(time.perf_counter() - start, 4))
        return report
    engine = opening.load(warn)
    load_seconds = time.perf_counter() - load_start
    if writer:
        opts.out_dir.mkdir(parents=True, exist_ok=True)
    record_file = results.ResultsFile(results_path) if writer else None
    total = sum(len(b.items) for b in pending)
    finished = 0
    loop_start = time.perf_counter()
    on_phase(f"running {total} item(s) in {len(pending)} batch(es)")
    try:
        with graceful_stop(warn) as stop:
            for batch in pending:
                records = _run_one(engine, batch, opts, writer, on_step)
                if record_file is not None:
                    record_file.append(records)
                finished += len(records)
                report.ok += sum(r.status == "ok" for r in records)
                report.failed += sum(r.status != "ok" for r in records)
                report.images += sum(len(r.outputs) for r in records)
                if on_progress is not None:
                    on_progress(finished, total, report.images)
                if stop.requested:
                    report.interrupted = finished < total
                    break
    finally:
        if record_file is not None:
            record_file.close()
    loop_seconds = time.perf_counter() - loop_start
    report.images_per_second = round(report.images / loop_seconds, 4) if loop_seconds > 0 else 0.0
    report.programs_compiled = engine.stats.programs_compiled
    report.programs_loaded = engine.stats.programs_loaded
    report.seconds = {k: round(v, 4) for k, v in
                      dict(load=load_seconds, run=loop_seconds, total=time.perf_counter() - start).items()}
    return report


def _run_one(engine: Engine, batch: Batch, opts: BatchOptions, writer: bool,
             on_step: Callable[[int, int], None] | None) -> list[results.Record]:
    """One device batch: its items planned again (references read now), run, written, recorded."""
    from flux2klein_cli.core.runs import run_record
    from flux2klein_cli.core.runs.image_files import write_png

    start = time.perf_counter()
    planned: list[tuple[Item, list[RunPlan]]] = []
    records: list[results.Record] = []
    for item in batch.items:
        try:
            planned.append((item, grouping.plan_entry(item.entry, engine.facts)))
        except UserInputError as e:  # a reference changed or vanished since the check
            records.append(results.error_record(item, grouping.field_message(e), 0.0))
    if not planned:
        return records
    try:
        runs = engine.run_batch([plan for _, plans in planned for plan in plans], on_step=on_step)
    except Flux2KleinError as e:
        seconds = time.perf_counter() - start
        return sorted(records + [results.error_record(item, grouping.field_message(e), seconds)
                                 for item, _ in planned],
                      key=lambda r: r.index)
    written: list[tuple[Item, str | None]] = []
    lora = engine.lora_records
    first = 0
    for item, plans in planned:
        error = None
        if writer:
            try:
                for name, plan, run in zip(item.outputs, plans, runs[first:first + len(plans)], strict=True):
                    path = opts.out_dir / name
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_png(path, run.images[0], run_record.encode(plan, 0, engine.options, lora), force=True)
            except (Flux2KleinError, OSError) as e:
                error = grouping.field_message(e) if isinstance(e, Flux2KleinError) else str(e)
        first += len(plans)
        written.append((item, error))
    seconds = time.perf_counter() - start
    for item, error in written:
        if error is not None:
            records.append(results.error_record(item, error, seconds))
        elif writer:
            records.append(results.ok_record(item, opts.out_dir, seconds))
        else:
            records.append(results.Record(item.index, item.entry.line, "ok", list(item.outputs), item.seeds[0],
                                          list(item.seeds), round(seconds, 4), None, item.digest))
    return sorted(records, key=lambda r: r.index)
