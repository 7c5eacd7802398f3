"""Flax NNX objects in a checkpointed state: saved as their `nnx.State`, restored as objects again.

An NNX train state is often the objects themselves, ``(model, optimizer)``
(NNX modules and optimizers are pytrees). Their key paths mix attribute names
and the integer keys of ``nnx.List`` and optimizer states in a way Orbax
cannot read back ("'<' not supported between instances of 'str' and 'int'"
at restore). Their `nnx.State` has the same arrays under plain dictionary
keys, which Orbax reads back; so each NNX object is saved as its state, and
restored into the target's objects (`nnx.merge` with the target's graph).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

__all__ = ["as_states"]


def _is_object(x: Any) -> bool:
    return isinstance(x, nnx.Pytree)


def as_states(tree: Any) -> tuple[Any, Callable[[Any], Any]]:
    """``tree`` with every NNX object replaced by its `nnx.State`, and the function that turns a tree of that
    form (restored arrays) back into objects like ``tree``'s. Without NNX objects: ``tree`` itself."""
    flat, treedef = jax.tree.flatten(tree, is_leaf=_is_object)
    split = {i: nnx.split(x) for i, x in enumerate(flat) if _is_object(x)}
    if not split:
        return tree, lambda restored: restored
    parts = [split[i][1] if i in split else x for i, x in enumerate(flat)]
    structures: list[jax.tree_util.PyTreeDef] = [jax.tree.structure(part) for part in parts]

    def as_objects(restored: Any) -> Any:
        leaves, out = iter(jax.tree.leaves(restored)), []
        for i, structure in enumerate(structures):
            part = jax.tree.unflatten(structure, [next(leaves) for _ in range(structure.num_leaves)])
            out.append(nnx.merge(split[i][0], part) if i in split else part)
        return jax.tree.unflatten(treedef, out)

    return jax.tree.unflatten(treedef, parts), as_objects
