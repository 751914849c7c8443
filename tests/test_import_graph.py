"""The package's modules import one another without a cycle, and only downwards.

Every import counts, top-level and deferred into a function alike: a deferred import only
delays a dependency to call time, it does not remove it, and the cycles this test was
written for (compile <-> pipeline, converted <-> orbax_store) were both hidden that way.
Only imports under `if TYPE_CHECKING:` are left out: they never run, and name a type.

The direction: each role package of core/ (and cli/) may import only the roles MAY_IMPORT
gives it, the "may import" column of docs/architecture.md's module map.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flux2klein_cli

PACKAGE = Path(flux2klein_cli.__file__).resolve().parent

# Role -> the roles its modules may import (besides their own). "foundations" are the modules at
# core/ top level (errors, choices, paths, ...) and the package roots; every role imports them.
# models, weights and hub share a layer (models declare key plans with weights.loader, weights
# build models to load into, hub's checkpoint loads all three): their module graph has no cycle.
_MODEL_LAYER = {"foundations", "devices", "models", "weights", "hub"}
MAY_IMPORT: dict[str, set[str]] = {
    "foundations": set(),
    "devices": {"foundations"},
    "models": {"foundations", "devices", "weights"},
    "weights": _MODEL_LAYER,
    "hub": _MODEL_LAYER,
    "lora": _MODEL_LAYER,
    "pipeline": _MODEL_LAYER | {"lora"},
    "compile": _MODEL_LAYER | {"lora", "pipeline"},
    # A request's inputs (references, init image and mask, noise files), read and sized on the
    # foundations alone, so the engine's plan reads them from below.
    "inputs": {"foundations"},
    # The engine (plans and the long-lived Engine) is below every door: it imports nothing of runs.
    "engine": _MODEL_LAYER | {"lora", "pipeline", "compile", "inputs"},
    "runs": _MODEL_LAYER | {"lora", "pipeline", "compile", "inputs", "engine"},
    "serve": _MODEL_LAYER | {"lora", "pipeline", "compile", "inputs", "engine", "runs"},
    "cli": _MODEL_LAYER | {"lora", "pipeline", "compile", "inputs", "engine", "runs", "serve"},
    "__main__": {"cli"},
}


def module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST) -> list[str]:
    """Every module named by an import anywhere in `tree` (`from a import b` names a and a.b)."""
    found: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking(node):
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: {m for m in _imports(ast.parse(path.read_text())) if m in modules and m != name}
            for name, path in modules.items()}


def role(module: str) -> str:
    """The role of a module: cli, __main__, a package of core/, or foundations."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("cli", "__main__"):
        return parts[1]
    if len(parts) > 2 and parts[1] == "core" and parts[2] in MAY_IMPORT:
        return parts[2]
    return "foundations"


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import that goes against MAY_IMPORT, as "a -> b (role -> role)"."""
    out = []
    for name, imported in sorted(graph.items()):
        for other in sorted(imported):
            mine, theirs = role(name), role(other)
            if theirs != mine and theirs not in MAY_IMPORT[mine]:
                out.append(f"{name} -> {other} ({mine} -> {theirs})")
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_go_down_the_layers() -> None:
    violations = layer_violations(import_graph())
    assert not violations, "imports against docs/architecture.md's layers:\n" + "\n".join(violations)


def test_every_core_package_has_a_role() -> None:
    # A new package under core/ needs its line in MAY_IMPORT (and in docs/architecture.md);
    # otherwise its modules would count as foundations, which nothing may import against.
    packages = {p.parent.relative_to(PACKAGE / "core").parts[0] for p in (PACKAGE / "core").rglob("*.py")
                if p.parent != PACKAGE / "core"}
    assert packages <= set(MAY_IMPORT), sorted(packages - set(MAY_IMPORT))


def test_the_layer_rule_catches_an_upward_import() -> None:
    up = {"flux2klein_cli.core.models.vae": {"flux2klein_cli.core.runs.generate", "flux2klein_cli.core.errors"},
          "flux2klein_cli.core.runs.generate": {"flux2klein_cli.cli.output"},
          "flux2klein_cli.core.engine.plan": {"flux2klein_cli.core.runs.image_files", "flux2klein_cli.core.inputs"},
          "flux2klein_cli.core.devices.mesh": {"flux2klein_cli.core.hub.checkpoint"},
          "flux2klein_cli.core.errors": {"flux2klein_cli.core.choices"},
          "flux2klein_cli.cli.app": {"flux2klein_cli.core.runs.bench.run", "flux2klein_cli"}}
    assert layer_violations(up) == [
        "flux2klein_cli.core.devices.mesh -> flux2klein_cli.core.hub.checkpoint (devices -> hub)",
        "flux2klein_cli.core.engine.plan -> flux2klein_cli.core.runs.image_files (engine -> runs)",
        "flux2klein_cli.core.models.vae -> flux2klein_cli.core.runs.generate (models -> runs)",
        "flux2klein_cli.core.runs.generate -> flux2klein_cli.cli.output (runs -> cli)",
    ]


def test_the_walk_sees_deferred_imports_and_cycles() -> None:
    # The checker itself: a deferred import is an edge, a TYPE_CHECKING one is not, and a cycle is found.
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import c\ndef f():\n    from b import x\n")
    assert set(_imports(tree)) == {"a", "b", "b.x"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "flux2klein_cli.core.pipeline.programs" in graph["flux2klein_cli.core.compile.specs"]


_ENVIRONMENT = ("environ", "getenv", "putenv", "unsetenv", "environb")


def environment_uses(tree: ast.AST) -> list[str]:
    """Each use of the process environment in `tree`, as `os.environ.setdefault`, `os.getenv`, ..."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"os.{a.name}" for a in node.names if a.name in _ENVIRONMENT]
        elif (isinstance(node, ast.Attribute) and node.attr in _ENVIRONMENT and isinstance(node.value, ast.Name)
              and node.value.id == "os"):
            found.append(f"os.{node.attr}")
    for node in ast.walk(tree):  # what is done with os.environ: os.environ.get, os.environ.setdefault
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            found.append(f"os.environ.{node.attr}")
    return sorted(found)


def test_the_environment_is_read_in_one_module_and_written_by_the_entry_point() -> None:
    """core/settings.py reads every variable; the console entry (cli/main.py) alone writes, and only
    defaults (`setdefault`); no other module touches os.environ."""
    uses = {name: environment_uses(ast.parse(path.read_text())) for name, path in module_names().items()}
    readers = {name for name, found in uses.items() if found}
    assert readers == {"flux2klein_cli.core.settings", "flux2klein_cli.cli.main"}, sorted(readers)
    assert uses["flux2klein_cli.cli.main"] == ["os.environ", "os.environ.setdefault"]
    assert environment_uses(ast.parse("from os import getenv\nimport os\nos.environ['A'] = '1'\n")) == [
        "os.environ", "os.getenv"]
