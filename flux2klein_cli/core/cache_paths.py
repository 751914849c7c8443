"""Where flux2klein keeps its caches: the root and every folder under it, computed here only
(the variables are read in core/settings.py).

The root is `$FLUX2KLEIN_CACHE`, else `$XDG_CACHE_HOME/flux2klein`, else `~/.cache/flux2klein`.
Each cache is a folder under it; the executable store (`$FLUX2KLEIN_COMPILE_CACHE`) and the
built CPU kernel shim (`$FLUX2KLEIN_NATIVE_CACHE`) may be moved on their own, and jax's persistent
XLA cache is a folder here only when FLUX2KLEIN_XLA_CACHE says `on` (core/devices/runtime.py reads
that switch). Hub snapshots are not ours: huggingface_hub places them (HF_HOME, HF_HUB_CACHE).
"""

from __future__ import annotations

from pathlib import Path

from flux2klein_cli.core import settings


def cache_root() -> Path:
    value = settings.cache_root()
    if value:
        return Path(value).expanduser()
    base = settings.xdg_cache_home() or Path.home() / ".cache"
    return Path(base).expanduser() / "flux2klein"


def executables_dir() -> Path:
    """The executable store's default: `$FLUX2KLEIN_COMPILE_CACHE`, else `executables/` under the root."""
    value = settings.compile_cache()
    if value:
        return Path(value).expanduser()
    return cache_root() / "executables"


def generated_dir(name: str) -> Path:
    """A checkpoint written locally (`tiny`, `tiny-kv`), by its versioned folder name."""
    return cache_root() / name


def composed_dir() -> Path:
    """Snapshots with `--transformer` / `--vae` in place of their own components."""
    return cache_root() / "composed"


def converted_dir() -> Path:
    """`flux2klein convert`'s output when no --out is given."""
    return cache_root() / "converted"


def xla_dir() -> Path:
    """jax's persistent compilation cache, when FLUX2KLEIN_XLA_CACHE=on."""
    return cache_root() / "xla"


def native_dir() -> Path:
    """Native code built on first use (the CPU kernel shim): `$FLUX2KLEIN_NATIVE_CACHE`, else `native/`
    under the root. Its own variable because a build takes about 20 s and depends on the source,
    jaxlib and the flags alone, so jobs that each start on a fresh cache root can share one."""
    value = settings.native_cache()
    if value:
        return Path(value).expanduser()
    return cache_root() / "native"

