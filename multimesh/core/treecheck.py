"""Compare two pytrees and say, by path, how they differ."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from .metadata import path_str

__all__ = ["check_same_structure", "static_difference", "tree_differences"]


def _leaves_by_path(tree: Any) -> dict[str, Any]:
    return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def tree_differences(expected: Any, got: Any, *, shapes: bool = True, limit: int = 20) -> list[str]:
    """Human-readable differences: missing and unexpected paths, then shape/dtype mismatches."""
    want, have = _leaves_by_path(expected), _leaves_by_path(got)
    diffs = [f"missing: {p}" for p in want if p not in have]
    diffs += [f"unexpected: {p}" for p in have if p not in want]
    if shapes:
        for p in want.keys() & have.keys():
            a, b = want[p], have[p]
            sa, sb = tuple(getattr(a, "shape", ())), tuple(getattr(b, "shape", ()))
            if sa != sb:
                diffs.append(f"shape of {p}: expected {sa}, got {sb}")
            elif hasattr(a, "dtype") and hasattr(b, "dtype") and a.dtype != b.dtype:
                diffs.append(f"dtype of {p}: expected {a.dtype}, got {b.dtype}")
    if not diffs:
        # typed as the public PyTreeDef: the alias in jax's own hints is no type to mypy (jaxlib has no stubs)
        want_structure: jax.tree_util.PyTreeDef = jax.tree.structure(expected)
        got_structure: jax.tree_util.PyTreeDef = jax.tree.structure(got)
        if want_structure != got_structure:
            diffs.append(f"same paths but different containers: expected {want_structure}, got {got_structure}")
    if len(diffs) > limit:
        diffs = diffs[:limit] + [f"... and {len(diffs) - limit} more"]
    return diffs


def check_same_structure(expected: Any, got: Any, what: str) -> None:
    diffs = tree_differences(expected, got, shapes=False)
    if diffs:
        raise ValueError(
            f"{what} has a different tree structure than the one the sharded function was built for:\n  "
            + "\n  ".join(diffs)
        )


def _one_level(x: Any) -> tuple[list, Any]:
    """``x``'s children and its own tree node (the children as leaves)."""
    return jax.tree_util.tree_flatten(x, is_leaf=lambda n: n is not x)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 70 else text[:67] + "..."


def _static_fields(expected: Any, got: Any) -> list[str]:
    """The dataclass fields that are not pytree children and differ (Flax ``struct.field(pytree_node=False)``)."""
    if not dataclasses.is_dataclass(expected) or type(expected) is not type(got):
        return []
    out = []
    for f in dataclasses.fields(expected):
        if f.metadata.get("pytree_node", True) and not f.metadata.get("static", False):
            continue
        a, b = getattr(expected, f.name, None), getattr(got, f.name, None)
        try:
            same = a is b or bool(a == b)
        except Exception:  # an == that does not give one bool (arrays): not equal
            same = False
        if not same:
            out.append(f.name)
    return out


def static_difference(expected: Any, got: Any, what: str) -> str | None:
    """Where ``got`` has the same leaf paths as ``expected`` but other static data, in one line, or None.

    Static data is what a pytree node keeps besides its children: a Flax
    ``TrainState``'s ``tx`` and ``apply_fn``, a namedtuple's type, a custom
    node's aux data. Made again (``optax.adam(...)`` called twice), such an
    object is usually a new one that does not compare equal, so the trees
    differ although every array is where it was.
    """
    if [p for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]] != \
            [p for p, _ in jax.tree_util.tree_flatten_with_path(got)[0]]:
        return None

    def walk(a: Any, b: Any, path: tuple) -> str | None:
        kids_a, node_a = _one_level(a)
        kids_b, node_b = _one_level(b)
        if node_a != node_b and len(kids_a) == len(kids_b):
            where = f"{what} {path_str(path)}" if path else what
            fields = _static_fields(a, b)
            if fields:
                f = fields[0]
                return (f"{where}: the static field {f!r} of {type(a).__name__} is "
                        f"{_short(getattr(b, f))}, not the object the step was built with "
                        f"({_short(getattr(a, f))})")
            return f"{where}: a {type(b).__name__} whose static data differs from the one the step was built with"
        if jax.tree_util.treedef_is_leaf(node_a):
            return None
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(a, is_leaf=lambda n: n is not a)[0]]
        for key, ka, kb in zip(paths, kids_a, kids_b):
            found = walk(ka, kb, path + tuple(key))
            if found:
                return found
        return None

    return walk(expected, got, ())
