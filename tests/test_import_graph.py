"""The package's modules import one another without a cycle.

Every import counts, top-level and deferred into a function alike: a deferred import only
delays a dependency to call time, it does not remove it, and the cycles this test was
written for (compile <-> pipeline, converted <-> orbax_store) were both hidden that way.
Only imports under `if TYPE_CHECKING:` are left out: they never run, and name a type.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flux2klein_cli

PACKAGE = Path(flux2klein_cli.__file__).resolve().parent


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


def test_the_walk_sees_deferred_imports_and_cycles() -> None:
    # The checker itself: a deferred import is an edge, a TYPE_CHECKING one is not, and a cycle is found.
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import c\ndef f():\n    from b import x\n")
    assert set(_imports(tree)) == {"a", "b", "b.x"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "flux2klein_cli.core.pipeline.programs" in graph["flux2klein_cli.core.compile.specs"]
