"""The base install (`pip install -e .`, no extras) provides everything the package imports.

Each import in flux2klein_cli is read from the source (ast), so an import that only some
command reaches is checked too. A module must come from the standard library, from a
dependency pyproject.toml declares directly (a package that only arrives through another
one, as etils did through orbax, is not enough), or, imported inside a function, from the
extra that `core/extras.py` names.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flux2klein_cli"
# Modules of an extra, never needed by the base install, and where each is checked.
EXTRA_MODULES = {"torch": "parity", "diffusers": "parity", "libtpu": "tpu", **dict.fromkeys(
    ("fastapi", "pydantic", "uvicorn", "prometheus_client"), "serve")}


def normalize(name: str) -> str:
    """PEP 503: Jinja2, jinja2 and jinja_2 name one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalize(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def imports(source: str) -> dict[str, bool]:
    """Top-level module -> whether every import of it is inside a function (lazy)."""
    tree = ast.parse(source)
    lazy_nodes = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for node in ast.walk(fn)}
    found: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            found[top] = found.get(top, True) and id(node) in lazy_nodes
    return found


def undeclared(modules: Mapping[str, bool], declared: Iterable[str], providers: Mapping[str, list[str]],
               extras: Mapping[str, str]) -> list[str]:
    """What the base install would not provide: one sentence per module."""
    declared = {normalize(d) for d in declared}
    problems = []
    for module, lazy in sorted(modules.items()):
        if module in sys.stdlib_module_names or module == "flux2klein_cli":
            continue
        if module in extras:
            if not lazy:
                problems.append(f"{module} (the [{extras[module]}] extra) is imported at module level")
            continue
        dists = {normalize(d) for d in providers.get(module, [])}
        if not dists:
            problems.append(f"{module} is not installed, so no declared dependency provides it")
        elif not dists & declared:
            problems.append(f"{module} comes from {', '.join(sorted(dists))}, not a declared dependency")
    return problems


def package_imports() -> dict[str, bool]:
    merged: dict[str, bool] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, lazy in imports(path.read_text()).items():
            merged[module] = merged.get(module, True) and lazy
    return merged


def test_every_runtime_import_is_a_declared_base_dependency() -> None:
    project = pyproject()["project"]
    declared = [requirement_name(r) for r in project["dependencies"]]
    modules = package_imports()
    assert {"jax", "jinja2", "tensorstore", "etils", "PIL"} <= set(modules)  # the scan sees the package
    assert undeclared(modules, declared, packages_distributions(), EXTRA_MODULES) == []
    for module, extra in EXTRA_MODULES.items():
        assert extra in project["optional-dependencies"], module


def test_the_check_fails_on_an_undeclared_or_eager_import() -> None:
    providers = {"jinja2": ["Jinja2"], "etils": ["etils"], "orbax": ["orbax-checkpoint"]}
    source = "import orbax.checkpoint\nfrom etils import epath\nimport torch\n\ndef f():\n    import jinja2\n"
    problems = undeclared(imports(source), ["orbax_checkpoint"], providers, {"torch": "parity"})
    assert problems == [
        "etils comes from etils, not a declared dependency",
        "jinja2 comes from jinja2, not a declared dependency",
        "torch (the [parity] extra) is imported at module level",
    ]
    assert undeclared({"nowhere": True}, [], {}, {}) == ["nowhere is not installed, so no declared dependency "
                                                         "provides it"]
    assert imports("def f():\n    import torch\nimport torch.nn\n") == {"torch": False}


@pytest.fixture
def no_parity_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a base install: torch and diffusers cannot be found or imported."""
    for name in ("torch", "diffusers"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("args", [
    ["parity", "--model", "tiny", "--height", "64", "--width", "64"],
    ["bench", "--model", "tiny", "--phase", "ttfi", "--height", "64", "--width", "64", "--diffusers"],
])
def test_parity_features_name_the_extra_on_a_base_install(no_parity_extra: None, args: list[str],
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'flux2klein-cli[parity]'" in lines[0], result.stderr
    assert "torch and diffusers" in lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing written: no parity/ folder, no tiny checkpoint


def test_bench_load_skips_diffusers_without_the_extra(no_parity_extra: None) -> None:
    from flux2klein_cli.core.runs.bench.load import KINDS, load_kinds

    notes: list[str] = []
    assert load_kinds(notes.append) == tuple(k for k in KINDS if k != "diffusers")
    assert len(notes) == 1 and "[parity]" in notes[0]


def test_tiny_kv_is_a_generated_kv_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flux2klein_cli.core.errors import UserInputError
    from flux2klein_cli.core.hub.layout import Snapshot
    from flux2klein_cli.core.hub.snapshot import TINY_KV_DIR_NAME, resolve

    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path))
    resolved = resolve("tiny-kv")
    assert resolved.kind == "generated" and resolved.path == tmp_path / TINY_KV_DIR_NAME
    assert Snapshot.open(resolved.path).kv
    assert [p.name for p in tmp_path.iterdir()] == [TINY_KV_DIR_NAME]  # no temporary left, tiny not written
    with pytest.raises(UserInputError, match="tiny-kv"):
        resolve("tiny-kv", revision="main")


def test_readme_quick_start_is_what_ci_runs() -> None:
    """.ci/run takes the first line of the bash block under "## Quick start" and runs it as written."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.splitlines() == ['pip install -e . && flux2klein generate "a red fox in snow" --model tiny -o fox.png']
    ci = (ROOT / ".ci" / "run").read_text()
    assert "/^## Quick start/" in ci and '"pip install -e . && flux2klein "*' in ci
