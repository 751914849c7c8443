"""Where one CLI process's time goes: runs `flux2klein ARGS...` in this process and prints, on stderr,
the seconds since the process was spawned at which chosen functions start and end, and the thread
each runs in (docs/benchmarks.md, "IPython and the executables' loads on the TPU host").

    T_SPAWN=$(python -c 'import time; print(time.time())') python benchmarks/ttfi_timeline.py \\
        generate "a photo of a cat" --model /tmp/cmp/medium -o /tmp/t.png --dtype fp32 --json

T_SPAWN (the shell's clock just before it starts Python) puts the interpreter's own start-up on the
timeline; without it the times count from this script's first line.
"""

from __future__ import annotations

import builtins
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SPAWNED = time.perf_counter() - (time.time() - float(os.environ.get("T_SPAWN", time.time())))
TIMED = (  # (module, attribute path): wrapped as soon as the module has it
    ("flux2klein_cli.core.runs.generate", "run_generate"),
    ("flux2klein_cli.core.engine.opening", "Opening.admitted"),
    ("flux2klein_cli.core.devices.distributed", "run_mesh"),
    ("flux2klein_cli.core.engine.cost", "parameter_bytes"),
    ("flux2klein_cli.core.weights.converted", "abstract_component"),
    ("flux2klein_cli.core.engine.opening", "Opening.load"),
    ("flux2klein_cli.core.pipeline.pipeline", "load_models"),
    ("flux2klein_cli.core.models.transformer", "load_transformer"),
    ("flux2klein_cli.core.models.qwen3", "load_qwen3"),
    ("flux2klein_cli.core.models.vae", "load_vae"),
    ("flux2klein_cli.core.compile.attach", "pipeline_programs"),
    ("flux2klein_cli.core.pipeline.pipeline", "load_tokenizer_and_scheduler"),
    ("flux2klein_cli.core.compile.attach", "compile_all"),
    ("flux2klein_cli.core.engine.engine", "Engine.run"),
    ("flux2klein_cli.core.runs.image_files", "write_png"),
)
_wrapped: set[tuple[str, str]] = set()


def stamp(message: str) -> None:
    print(f"[{time.perf_counter() - SPAWNED:6.3f}] {message} ({threading.current_thread().name})", file=sys.stderr)


def timed(label: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stamp(f"> {label}")
        try:
            return function(*args, **kwargs)
        finally:
            stamp(f"< {label}")

    return wrapper


def wrap_loaded() -> None:
    for module_name, path in TIMED:
        module = sys.modules.get(module_name)
        if (module_name, path) in _wrapped or module is None:
            continue
        *owners, name = path.split(".")
        owner: Any = module
        try:  # a module still loading may not have it yet
            for part in owners:
                owner = getattr(owner, part)
            getattr(owner, name)
        except AttributeError:
            continue
        setattr(owner, name, timed(path, getattr(owner, name)))
        _wrapped.add((module_name, path))


_import = builtins.__import__


def importing(name: str, *args: Any, **kwargs: Any) -> Any:
    module = _import(name, *args, **kwargs)
    if name.startswith("flux2klein_cli"):
        wrap_loaded()
    return module


if __name__ == "__main__":
    stamp("python up")
    builtins.__import__ = importing
    sys.argv = ["flux2klein", *sys.argv[1:]]
    from flux2klein_cli.cli.main import console

    console()
