"""One cache root: every folder flux2klein keeps follows FLUX2KLEIN_CACHE, and only
core/cache_paths.py reads the variables that place it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from flux2klein_cli.core import cache_paths
from flux2klein_cli.core.compile.store import ExecutableStore
from flux2klein_cli.core.devices import runtime

PACKAGE = Path(__file__).resolve().parents[1] / "flux2klein_cli"
SUB_ROOTS = [f for name, f in inspect.getmembers(cache_paths, inspect.isfunction)
             if f.__module__ == cache_paths.__name__ and not inspect.signature(f).parameters]


def test_every_sub_root_moves_with_flux2klein_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FLUX2KLEIN_COMPILE_CACHE", raising=False)
    monkeypatch.delenv("FLUX2KLEIN_NATIVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "mine"))
    assert len(SUB_ROOTS) >= 6
    for sub_root in [*SUB_ROOTS, lambda: cache_paths.generated_dir("tiny-v1")]:
        assert sub_root().is_relative_to(tmp_path / "mine"), sub_root
    # The callers: the executable store, jax's XLA cache when on, the CPU kernel shim.
    assert ExecutableStore().root == tmp_path / "mine" / "executables"
    monkeypatch.setenv("FLUX2KLEIN_XLA_CACHE", "on")
    assert runtime.xla_cache_dir() == tmp_path / "mine" / "xla"
    from flux2klein_cli.core.models import cpu_shim

    assert cpu_shim.shim_path().is_relative_to(tmp_path / "mine")


def test_the_store_and_the_shim_move_on_their_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """FLUX2KLEIN_COMPILE_CACHE and FLUX2KLEIN_NATIVE_CACHE move one folder each; the rest stay under the root."""
    from flux2klein_cli.core.models import cpu_shim

    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "root"))
    monkeypatch.setenv("FLUX2KLEIN_COMPILE_CACHE", str(tmp_path / "store"))
    monkeypatch.setenv("FLUX2KLEIN_NATIVE_CACHE", str(tmp_path / "shim"))
    assert ExecutableStore().root == tmp_path / "store"
    assert cpu_shim.shim_path().parent == tmp_path / "shim"
    moved = {cache_paths.executables_dir, cache_paths.native_dir}
    for sub_root in SUB_ROOTS:
        if sub_root not in moved:
            assert sub_root().is_relative_to(tmp_path / "root"), sub_root


def test_without_flux2klein_cache_the_root_is_under_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FLUX2KLEIN_CACHE", raising=False)
    monkeypatch.delenv("FLUX2KLEIN_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_paths.cache_root() == tmp_path / "flux2klein"
    assert ExecutableStore().root == tmp_path / "flux2klein" / "executables"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_paths.cache_root() == tmp_path / "home" / ".cache" / "flux2klein"


def test_the_compile_cache_variable_moves_only_the_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("FLUX2KLEIN_COMPILE_CACHE", str(tmp_path / "exe"))
    assert ExecutableStore().root == tmp_path / "exe"
    assert cache_paths.composed_dir() == tmp_path / "mine" / "composed"


def test_no_other_module_reads_the_cache_variables() -> None:
    """settings.py reads every variable (test_import_graph holds that); cache_paths.py alone turns
    the cache ones into folders."""
    pattern = re.compile(r"""["'](FLUX2KLEIN_CACHE|FLUX2KLEIN_COMPILE_CACHE|XDG_CACHE_HOME|\.cache)["']""")
    readers = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
               if path.name not in ("cache_paths.py", "settings.py") and pattern.search(path.read_text())]
    assert readers == []
