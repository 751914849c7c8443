"""Work around one third-party module's import: the console entry (cli/main.py) installs these
before anything heavy loads. Only the standard library is imported here."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType

# (the module's own exec_module, the module): runs the module, and whatever goes around it.
Around = Callable[[Callable[[ModuleType], None], ModuleType], None]


class _AroundImport(importlib.abc.MetaPathFinder):
    """The import of `name` runs inside `around`, once: the finder steps aside when asked for
    the module, lets the regular finders locate it, and wraps its loader."""

    def __init__(self, name: str, around: Around):
        self.name, self.around = name, around

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module  # type: ignore[attr-defined]
        loader.exec_module = lambda module: self.around(original_exec, module)  # type: ignore[method-assign]
        return spec


def around_import(name: str, around: Around) -> None:
    """Run the coming import of module `name` inside `around`; nothing when it is imported already
    (an in-process caller that runs the CLI again)."""
    if name not in sys.modules and not any(isinstance(f, _AroundImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AroundImport(name, around))


def _without_ipython(run: Callable[[ModuleType], None], module: ModuleType) -> None:
    if "IPython" in sys.modules:  # an IPython session, or a process that imported it: flax asks it
        run(module)
        return
    sys.modules["IPython"] = None  # type: ignore[assignment]  # `import IPython` raises ImportError
    try:
        run(module)
    finally:
        if "IPython" in sys.modules and sys.modules["IPython"] is None:
            del sys.modules["IPython"]


def skip_ipython_probes() -> None:
    """flax.nnx and the treescope it loads import IPython as they load (three modules of theirs),
    to ask whether they run in an IPython shell and to define its magics: on a host with IPython
    installed that is over a hundred modules in every command's start (docs/benchmarks.md). A
    process that has not imported IPython runs no IPython shell, so their answer is no whatever
    IPython would say: while flax.nnx loads, IPython reads as absent; it imports as usual afterwards."""
    around_import("flax.nnx", _without_ipython)
