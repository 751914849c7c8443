"""The console entry keeps flax.nnx from importing IPython on a host that has it (core/import_hooks.py).

A stand-in IPython package on the path records each import of it in a file, and its `get_ipython`
answers like a running shell. Each case runs in a fresh interpreter: the hook acts on first imports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

STAND_IN = '''
import os
with open(os.environ["IPYTHON_MARK"], "a") as f:
    f.write("imported\\n")

def get_ipython():
    return object()  # a shell: whoever asks is told it runs in one
'''
# What treescope defines its magics with when IPython imports.
MAGIC = '''
def magics_class(cls):
    return cls

class Magics:
    pass

def cell_magic(name_or_function):
    return name_or_function if callable(name_or_function) else (lambda function: function)
'''


@pytest.fixture
def ipython_on_path(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "site" / "IPython"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    (package / "core").mkdir()
    for name, text in (("core/__init__.py", ""), ("core/formatters.py", ""), ("core/magic.py", MAGIC),
                       ("display.py", "")):
        (package / name).write_text(text)
    mark = tmp_path / "ipython-imports"
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), *sys.path]),
                IPYTHON_MARK=str(mark), JAX_PLATFORMS="cpu")


def python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def imports(env: dict[str, str]) -> int:
    mark = Path(env["IPYTHON_MARK"])
    return len(mark.read_text().splitlines()) if mark.exists() else 0


def test_flax_nnx_imports_ipython_without_the_hook(ipython_on_path: dict[str, str]) -> None:
    """What the hook is for: when this fails, flax no longer asks and the hook can go."""
    out = python("import flax.nnx.visualization as v; print(v.in_ipython)", ipython_on_path)
    assert imports(ipython_on_path) >= 1 and out == "True"


def test_a_cli_command_loads_flax_nnx_without_importing_ipython(ipython_on_path: dict[str, str]) -> None:
    out = python(
        "import sys\n"
        "sys.argv = ['flux2klein', 'env', '--json']\n"
        "from flux2klein_cli.cli.main import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "import flax.nnx.visualization as v\n"
        "print('flax.nnx' in sys.modules, 'IPython' in sys.modules, v.in_ipython)\n"
        "import IPython\n"  # importable as usual afterwards
        "print(IPython.get_ipython() is not None)\n",
        ipython_on_path,
    )
    assert out.splitlines()[-2:] == ["True False False", "True"]  # after env's JSON
    assert imports(ipython_on_path) == 1  # the explicit import only


def test_a_process_that_imported_ipython_keeps_flax_asking_it(ipython_on_path: dict[str, str]) -> None:
    out = python(
        "import IPython\n"
        "from flux2klein_cli.core.import_hooks import skip_ipython_probes\n"
        "skip_ipython_probes()\n"
        "import flax.nnx.visualization as v\n"
        "print(v.in_ipython)",
        ipython_on_path,
    )
    assert out == "True"


def test_the_hook_is_installed_once_and_not_after_the_import(ipython_on_path: dict[str, str]) -> None:
    out = python(
        "import sys\n"
        "from flux2klein_cli.core.import_hooks import skip_ipython_probes\n"
        "skip_ipython_probes(); skip_ipython_probes()\n"
        "hooks = lambda: sum(type(f).__name__ == '_AroundImport' for f in sys.meta_path)\n"
        "first = hooks()\n"
        "import flax.nnx\n"
        "skip_ipython_probes()\n"
        "print(first, hooks(), 'IPython' in sys.modules)",
        ipython_on_path,
    )
    assert out == "1 0 False"
    assert imports(ipython_on_path) == 0
