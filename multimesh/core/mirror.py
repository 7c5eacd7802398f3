"""Give outputs that mirror the inputs (new parameters, optimizer state) the inputs' shardings.

Every subtree of the input is indexed by its tree structure and leaf
shapes/dtypes; an output subtree with the same signature gets the input's
shardings, where the signature is unambiguous. Lone arrays inside the input
are not indexed: an output array that merely has a parameter's shape (an
activation, a user-constrained result) must keep the sharding the step gives
it. Only a whole input that is itself one array is matched as a leaf.
"""

from __future__ import annotations

from typing import Any

import jax

from .meshes import constrain

__all__ = ["MirrorIndex"]

_AMBIGUOUS = object()


def _children(x: Any) -> tuple[list, Any]:
    return jax.tree_util.tree_flatten(x, is_leaf=lambda n: n is not x)


def _is_leaf(x: Any) -> bool:
    return jax.tree_util.treedef_is_leaf(jax.tree.structure(x))


def _leafless(x: Any) -> bool:
    # typed as the public PyTreeDef: the alias in jax's own hints is no type to mypy (jaxlib has no stubs)
    structure: jax.tree_util.PyTreeDef = jax.tree.structure(x)
    return structure.num_leaves == 0


def signature(x: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(x)
    return treedef, tuple((tuple(getattr(l, "shape", ())), str(getattr(l, "dtype", type(l).__name__))) for l in leaves)


class MirrorIndex:
    """Shardings of every subtree of an abstract input tree, by signature."""

    def __init__(self, abstract: Any, shardings: Any):
        self._index: dict[tuple, Any] = {}
        self._add(abstract, shardings, root=True)

    def _add(self, tree: Any, shardings: Any, root: bool = False) -> None:
        if _leafless(tree) or (_is_leaf(tree) and not root):
            return
        key = signature(tree)
        if key in self._index and self._index[key] is not _AMBIGUOUS and not _same(self._index[key], shardings):
            self._index[key] = _AMBIGUOUS
        else:
            self._index.setdefault(key, shardings)
        if _is_leaf(tree):
            return
        kids, _ = _children(tree)
        skids, _ = jax.tree_util.tree_flatten(shardings, is_leaf=lambda n: n is not shardings)
        for k, s in zip(kids, skids):
            self._add(k, s)

    def lookup(self, tree: Any) -> Any | None:
        found = self._index.get(signature(tree))
        return None if found is _AMBIGUOUS else found

    def constrain(self, out: Any) -> Any:
        """Apply the matching input shardings to the mirror subtrees of ``out`` (inside jit)."""
        if _leafless(out):
            return out
        match = self.lookup(out)
        if match is not None:
            return jax.tree.map(constrain, out, match)
        if _is_leaf(out):
            return out
        kids, treedef = _children(out)
        return jax.tree_util.tree_unflatten(treedef, [self.constrain(k) for k in kids])

    def shardings_for(self, out_abstract: Any) -> Any:
        """The matched shardings for each leaf of ``out_abstract`` (None where unmatched)."""
        if _leafless(out_abstract):
            return out_abstract
        match = self.lookup(out_abstract)
        if match is not None:
            return match
        if _is_leaf(out_abstract):
            return None
        kids, treedef = _children(out_abstract)
        return jax.tree_util.tree_unflatten(treedef, [self.shardings_for(k) for k in kids])


def _same(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x == y for x, y in zip(la, lb))
