"""Pytree structures as plain JSON, so a stored executable's trees never go through pickle.

Only the node types a program's arguments and results are made of can be written or read:
tuples, lists, dicts with string keys, None, and the project's own pytree dataclasses listed
in NODE_TYPES. Anything else is a ValueError (the executable is then not stored); reading
builds the structure from those types alone, so a record cannot name code to run.
"""

from __future__ import annotations

from typing import Any

import jax

from flux2klein_cli.core.models.transformer import ReferenceKV

# Dataclass pytrees (no auxiliary data) by the name written to disk.
NODE_TYPES: dict[str, type] = {"ReferenceKV": ReferenceKV}
_NAMES = {cls: name for name, cls in NODE_TYPES.items()}
_LEAF = "*"


def _is_leaf(treedef: Any) -> bool:
    return treedef.num_nodes == 1 and treedef.num_leaves == 1


def encode(treedef: Any) -> Any:
    """A JSON-able description of a PyTreeDef."""
    if _is_leaf(treedef):
        return _LEAF
    kind, aux = treedef.node_data()
    children = [encode(child) for child in treedef.children()]
    if kind is type(None):
        return None
    if kind in (tuple, list):
        return {"tuple" if kind is tuple else "list": children}
    if kind is dict:
        keys = list(aux)
        if not all(isinstance(k, str) for k in keys):
            raise ValueError(f"dict keys {keys!r} are not all strings")
        return {"dict": [[k, c] for k, c in zip(keys, children, strict=True)]}
    if kind in _NAMES and not aux:
        return {"node": _NAMES[kind], "children": children}
    raise ValueError(f"pytree node type {kind.__name__} cannot be stored")


def _skeleton(data: Any) -> Any:
    if data == _LEAF:
        return object()  # any non-pytree object is a leaf
    if data is None:
        return None
    if not isinstance(data, dict) or len(data) not in (1, 2):
        raise ValueError(f"not a tree description: {str(data)[:60]}")
    if "tuple" in data:
        return tuple(_skeleton(c) for c in _list(data["tuple"]))
    if "list" in data:
        return [_skeleton(c) for c in _list(data["list"])]
    if "dict" in data:
        pairs = _list(data["dict"])
        if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
            raise ValueError("a dict node's entries are not [name, child] pairs")
        return {k: _skeleton(c) for k, c in pairs}
    cls = NODE_TYPES.get(data.get("node"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown pytree node type {str(data.get('node'))[:40]!r}")
    return cls(*(_skeleton(c) for c in _list(data.get("children"))))


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError("a node's children are not a list")
    return value


def decode(data: Any) -> Any:
    """The PyTreeDef `encode` described; ValueError for anything else."""
    try:
        return jax.tree_util.tree_structure(_skeleton(data))
    except (TypeError, RecursionError) as e:
        raise ValueError(f"not a tree description ({type(e).__name__})") from None
