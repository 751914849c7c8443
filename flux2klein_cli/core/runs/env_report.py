"""`flux2klein env`: what a run on this host would use, in one report, without loading a model.

Versions of the pieces that decide it (flux2klein, python, jax, jaxlib, flax, libtpu or jax's CUDA
plugin), the platform and its devices with their memory, the process count, what a CPU run's bf16
work runs on (core/models/kernels.py), the attention kind each platform's programs take
(core/models/trace.py), the cache root, the executable store's size and health, jax's persistent
XLA cache, every FLUX2KLEIN_* variable set and the limits table (core/limits.py). Each figure comes
from the module that decides it; nothing here restates a rule. Reading the stores writes nothing
(no store key is created, no folder made), and no CPU kernel shim is built: the report says where
the first run will build one.
"""

from __future__ import annotations

import os
import platform as host_platform
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from flux2klein_cli.core import settings, trust
from flux2klein_cli.core.errors import Flux2KleinError

# Distributions whose versions decide what a run does, by the name the report gives them (flux2klein is
# the flux2klein-cli distribution); a missing one reads None.
DISTRIBUTIONS = {"flux2klein": "flux2klein-cli", **{name: name for name in (
    "jax", "jaxlib", "flax", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
    "jax-cuda13-pjrt")}}
PLATFORMS = ("cpu", "gpu", "tpu")


@dataclass(frozen=True)
class DeviceReport:
    id: int
    platform: str
    kind: str
    process_index: int
    memory_bytes: int | None  # the device's memory (bytes_limit), or the host's for a CPU device
    memory_source: str  # "device", "host" (a CPU device: the host's RAM, shared) or "unknown"
    in_use_bytes: int | None = None


@dataclass(frozen=True)
class StoreReport:
    """The executable store (core/compile/store.py) as the next run would find it."""

    root: str
    exists: bool
    trusted: bool | None  # None: no store yet (made private on first use)
    why: str | None  # why it is not trusted, or what is missing
    entries: int  # entries with a readable meta.json
    signed_entries: int  # of those, records that carry this store's HMAC (usable, checksums aside)
    bytes: int  # every file under the root


@dataclass(frozen=True)
class XlaCacheReport:
    """jax's own persistent compilation cache (core/devices/runtime.py): off unless FLUX2KLEIN_XLA_CACHE says."""

    setting: str | None  # FLUX2KLEIN_XLA_CACHE as set
    state: str  # "off", "on" or "refused"
    dir: str | None
    why: str | None
    files: int
    bytes: int


@dataclass(frozen=True)
class EnvReport:
    versions: dict[str, str | None]
    python: str
    executable: str  # the interpreter (which venv)
    system: str
    platform: str  # the backend a run here uses: cpu, gpu, tpu
    devices: list[DeviceReport]
    process_count: int
    process_index: int
    host: dict[str, int | None]  # cpus, memory_bytes, available_bytes
    cpu_bf16: dict[str, str | None]  # kernels.report(): plugin (or None), onemkl, why, bf16_compute
    cpu_compile: dict[str, str]  # XLA options CPU programs compile with (devices/cpu.xla_options); {}: XLA's defaults
    attention: dict[str, str]  # platform -> attention kind its programs take (trace.ATTENTION_KINDS)
    cache_root: str
    executable_store: StoreReport
    xla_cache: XlaCacheReport
    environment: dict[str, str]  # every FLUX2KLEIN_* set
    jax_environment: dict[str, str]  # settings.JAX_VARIABLES set
    limits: list[dict[str, str]] | None  # core/limits.py's table; None where that module is absent
    problems: list[str] = field(default_factory=list)  # what the report found wrong (a bad variable, a refused store)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["line"] = self.line()
        return out

    def line(self) -> str:
        """One line to paste into a bug report."""
        v = self.versions
        libs = " ".join(f"{name} {v[name]}" for name in DISTRIBUTIONS if name != "flux2klein" and v.get(name))
        kinds = sorted({d.kind for d in self.devices})
        memory = [d.memory_bytes for d in self.devices if d.memory_bytes]
        mem = f", {min(memory) / 2**30:.1f} GiB{' host' if self.devices[0].memory_source == 'host' else ''}" \
            if memory else ""
        store = self.executable_store
        store_state = "trusted" if store.trusted else ("untrusted" if store.trusted is False else "none")
        bf16 = self.cpu_bf16.get("plugin") or "xla"
        return (f"flux2klein {v.get('flux2klein')} | python {self.python} | {libs} | {self.platform} "
                f"x{len(self.devices)} ({', '.join(kinds)}{mem}) | processes {self.process_count} | "
                f"attention {self.attention.get(self.platform, '?')} | cpu bf16 {bf16} | "
                f"store {store.entries} entries {store.bytes / 2**20:.1f} MiB {store_state} | "
                f"xla cache {self.xla_cache.state} | {self.system}")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, distribution in DISTRIBUTIONS.items():
        try:
            out[name] = version(distribution)
        except PackageNotFoundError:
            out[name] = None
    return out


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of this host's RAM; available from /proc/meminfo where there is one."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = None
    available = None
    try:
        for row in Path("/proc/meminfo").read_text().splitlines():
            if row.startswith("MemAvailable:"):
                available = int(row.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    return total, available


def device_report(device: Any, host_total: int | None) -> DeviceReport:
    """One device and its memory: what the runtime reports (bytes_limit), else the host's for a CPU."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        stats = {}
    limit, in_use = stats.get("bytes_limit"), stats.get("bytes_in_use")
    if limit:
        memory, source = int(limit), "device"
    elif device.platform == "cpu":
        memory, source = host_total, "host"
    else:
        memory, source = None, "unknown"
    return DeviceReport(id=int(device.id), platform=str(device.platform), kind=str(device.device_kind),
                        process_index=int(getattr(device, "process_index", 0)), memory_bytes=memory,
                        memory_source=source, in_use_bytes=None if in_use is None else int(in_use))


def tree_size(root: Path) -> tuple[int, int]:
    """(files, bytes) under `root`, links not followed."""
    files = total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                total += (Path(folder) / name).lstat().st_size
                files += 1
            except OSError:
                continue
    return files, total


def store_report(root: Path | None = None) -> StoreReport:
    """The executable store: its entries and bytes, and whether the next run would trust it. Read
    only: a store without a key keeps it missing (the first stored executable makes one)."""
    from flux2klein_cli.core.compile.store import ExecutableStore

    store = ExecutableStore(root)
    if not store.root.exists():
        return StoreReport(str(store.root), False, None, "no store yet (made on the first stored executable)",
                           0, 0, 0)
    key: bytes | None = None
    trusted: bool | None
    why: str | None = None
    try:
        trust.check_private_dir(store.root, "executable store")
        if (store.root / trust.KEY_FILE).exists():
            key, trusted = trust.store_key(store.root), True
        else:
            trusted, why = True, "no store key yet (made on the first stored executable)"
    except trust.Untrusted as e:
        trusted, why = False, str(e)
    metas = list(store.entries())
    signed = 0
    if key is not None:
        for meta in metas:
            try:
                trust.verify(meta, key)
                signed += 1
            except trust.Untrusted:
                continue
    _, nbytes = tree_size(store.root)
    return StoreReport(str(store.root), True, trusted, why, len(metas), signed, nbytes)


def xla_cache_report() -> XlaCacheReport:
    from flux2klein_cli.core.devices.runtime import xla_cache_dir

    setting = settings.xla_cache()
    try:
        cache = xla_cache_dir()
    except Flux2KleinError as e:  # not a folder: a run would refuse it
        return XlaCacheReport(setting, "refused", setting, str(e), 0, 0)
    if cache is None:
        return XlaCacheReport(setting, "off", None, None, 0, 0)
    if not cache.exists():
        return XlaCacheReport(setting, "on", str(cache), "made at the first compile", 0, 0)
    try:
        trust.check_private_dir(cache, "XLA cache")
    except trust.Untrusted as e:
        return XlaCacheReport(setting, "refused", str(cache), str(e), 0, 0)
    files, nbytes = tree_size(cache)
    return XlaCacheReport(setting, "on", str(cache), None, files, nbytes)


def attention_kinds(problems: list[str]) -> dict[str, str]:
    """Per platform, the attention its programs take here (trace.TraceOptions.for_platform)."""
    from flux2klein_cli.core.models.trace import TraceOptions

    out = {}
    for name in PLATFORMS:
        try:
            out[name] = TraceOptions.for_platform(name, build=False).attention
        except Flux2KleinError as e:  # a bad FLUX2KLEIN_* value: the run would refuse it too
            problems.append(str(e))
            return {}
    return out


def limits_table() -> list[dict[str, str]] | None:
    """core/limits.py's table (field, bound, what it bounds), or None while that module is absent."""
    try:
        from flux2klein_cli.core.limits import LIMITS
    except ImportError:
        return None
    return [dict(field=name, bound=bound, bounds=what) for name, bound, what in LIMITS.rows()]


def build_report() -> EnvReport:
    """The whole report; imports jax and starts its backend (fast: no model, no compile)."""
    start = time.perf_counter()
    import jax

    from flux2klein_cli.core.cache_paths import cache_root
    from flux2klein_cli.core.devices import cpu
    from flux2klein_cli.core.models import kernels

    problems: list[str] = []
    total, available = host_memory()
    devices = [device_report(d, total) for d in jax.devices()]
    store = store_report()
    if store.trusted is False:
        problems.append(f"executable store: {store.why}")
    xla = xla_cache_report()
    if xla.state == "refused":
        problems.append(f"XLA cache: {xla.why}")
    return EnvReport(
        versions=versions(),
        python=host_platform.python_version(),
        executable=sys.executable,
        system=f"{host_platform.system()} {host_platform.release()} {host_platform.machine()}",
        platform=devices[0].platform,
        devices=devices,
        process_count=int(jax.process_count()),
        process_index=int(jax.process_index()),
        host=dict(cpus=os.cpu_count(), memory_bytes=total, available_bytes=available),
        cpu_bf16=kernels.report(build=False),
        cpu_compile=cpu.xla_options(),
        attention=attention_kinds(problems),
        cache_root=str(cache_root()),
        executable_store=store,
        xla_cache=xla,
        environment=settings.ours(),
        jax_environment=settings.jax_environment(),
        limits=limits_table(),
        problems=problems,
        seconds=round(time.perf_counter() - start, 3),
    )
