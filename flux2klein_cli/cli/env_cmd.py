"""`flux2klein env`: what a run on this host would use (as `hf env` does), without loading a model."""

from __future__ import annotations

from typing import Any

from flux2klein_cli.cli import options as o
from flux2klein_cli.cli.output import Table, emit_json, result, show_table, user_errors, warn


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def env(as_json: o.JsonOpt = False) -> None:
    """Print what a run on this host uses: versions (flux2klein, python, jax, jaxlib, flax, libtpu or
    jax's CUDA plugin), the platform and each device with its memory, the process count, what a
    CPU run's bf16 work runs on, the attention kind per platform, the cache root, the executable
    store's size and health, jax's XLA cache, every FLUX2KLEIN_* variable set and the limits table.

    Loads no model and compiles nothing. The last line printed (the `line` field with --json) is one
    line to paste into a bug report. Problems found (an untrusted store, a bad variable) are warnings
    on stderr; the exit code stays 0.

    Example: flux2klein env

    Example: flux2klein env --json | python -m json.tool

    Example: flux2klein env | tail -n 1   # the bug-report line
    """
    with user_errors():
        from flux2klein_cli.core.runs.env_report import build_report

        report = build_report()
    if as_json:
        emit_json(report.as_dict())
        return
    for problem in report.problems:
        warn(problem)
    table = Table(title="flux2klein env", show_header=False)
    table.add_column("", justify="left")
    table.add_column("", justify="left")
    for name, value in table_rows(report):
        table.add_row(name, value)
    show_table(table)
    if report.limits is not None:
        limits = Table(title="limits (core/limits.py)")
        for column in ("field", "bound", "bounds"):
            limits.add_column(column, justify="left")
        for row in report.limits:
            limits.add_row(row["field"], row["bound"], row["bounds"])
        show_table(limits)
    result(report.line())


def table_rows(report: Any) -> list[tuple[str, str]]:
    rows = [(name, value or "not installed") for name, value in report.versions.items()
            if value or name in ("flux2klein", "jax", "jaxlib", "flax")]
    rows += [("python", f"{report.python} ({report.executable})"), ("system", report.system),
             ("platform", report.platform)]
    for d in report.devices:
        memory = _gib(d.memory_bytes) + (" (host, shared)" if d.memory_source == "host" else "")
        if d.in_use_bytes is not None:
            memory += f", {_gib(d.in_use_bytes)} in use"
        rows.append((f"device {d.id}", f"{d.kind} ({d.platform}, process {d.process_index}): {memory}"))
    rows.append(("processes", f"{report.process_count} (this is {report.process_index})"))
    host = report.host
    rows.append(("host", f"{host['cpus']} CPUs, {_gib(host['memory_bytes'])}, {_gib(host['available_bytes'])} "
                         "available"))
    bf16 = report.cpu_bf16
    rows.append(("cpu bf16",
                 f"{bf16.get('plugin') or 'XLA'}, bf16 computes as {bf16.get('bf16_compute')}: {bf16['why']}"))
    compile_options = ", ".join(f"{k}={v}" for k, v in report.cpu_compile.items())
    rows.append(("cpu compile", compile_options or "XLA's defaults"))
    rows.append(("attention", ", ".join(f"{p} {kind}" + (" (this host)" if p == report.platform else "")
                                        for p, kind in report.attention.items()) or "?"))
    rows.append(("cache root", report.cache_root))
    s = report.executable_store
    health = {True: "trusted", False: "NOT trusted", None: "none yet"}[s.trusted]
    detail = f"; {s.why}" if s.why else ""
    rows.append(("executable store", f"{s.root}: {s.entries} entries ({s.signed_entries} signed), "
                                     f"{_mib(s.bytes)}, {health}{detail}"))
    x = report.xla_cache
    xla = x.state if x.dir is None else f"{x.state}: {x.dir}, {x.files} files, {_mib(x.bytes)}"
    rows.append(("XLA cache", xla + (f"; {x.why}" if x.why else "")))
    rows += list(report.environment.items()) or [("FLUX2KLEIN_*", "none set")]
    rows += list(report.jax_environment.items())
    if report.limits is None:
        rows.append(("limits", "not available (core/limits.py absent)"))
    return rows
