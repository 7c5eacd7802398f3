"""A saved leaf's name: its path as the sharding report spells it.

A checkpoint's manifest keys each leaf by its full key path, which runs
through a Flax box's ``value`` attribute (Linen ``Partitioned``, NNX
``Variable``): ``params/Dense_0/kernel/value``. ``step_fn.report()`` and the
trainer's ``sharding.txt`` stop at the box: ``params/Dense_0/kernel``. The
manifest also records each leaf's name in the report's form, and the inspector
prints names, so that a path read off one can be found in the other.
"""

from __future__ import annotations

from typing import Any

import jax

from ..core.fmt import keypath_str
from ..core.metadata import is_box

__all__ = ["leaf_names", "name_of_unnamed"]

ROOT = "<root>"
_BOX_ATTRIBUTE = "value"


def leaf_names(tree: Any) -> list[str]:
    """The name of every array leaf of ``tree``, in flattening order: its key path
    without the ``value`` attribute of the Flax box that holds it."""
    names = []
    for keypath, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
        if is_box(node):  # the box's children start with its attribute key, which the report leaves out
            names += [keypath_str((*keypath, *inner[1:]), root=ROOT)
                      for inner, _ in jax.tree_util.tree_flatten_with_path(node)[0]]
        else:
            names.append(keypath_str(keypath, root=ROOT))
    return names


def name_of_unnamed(path: str) -> str:
    """The name of a leaf saved before manifests recorded names, from its ``path``.

    Every boxed Linen or NNX leaf's path ends in the box's ``value`` attribute,
    which is dropped; those manifests do not say whether a final ``value`` was
    a dictionary key instead, so an array saved under a key ``"value"`` is
    named without it too.
    """
    if path == _BOX_ATTRIBUTE:
        return ROOT
    suffix = "/" + _BOX_ATTRIBUTE
    return path[: -len(suffix)] if path.endswith(suffix) else path
