"""Read sharding annotations off pytrees: Flax Linen boxes and Flax NNX variables.

A *box* is a pytree node that wraps one array and carries metadata:
Linen's `Partitioned` (names are mesh axes), `LogicallyPartitioned` (names are
logical), and NNX's `Variable` (metadata ``out_sharding``, or the older
``sharding_names`` / ``sharding``; names resolved as logical, and since every
mesh axis also resolves to itself, mesh-axis names work too).

T5X-style Linen models (``flax.linen.partitioning.param_with_axes``) keep the
names beside the parameters instead: ``model.init`` returns a ``params_axes``
collection next to ``params``, an ``AxisMetadata`` per parameter. A leaf under
such a ``params`` is named by its entry there; a leaf elsewhere (an optimizer
moment) whose path ends with a named parameter's path inside its collection,
and whose shape is that parameter's, is named alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx
from flax.core import meta as linen_meta
from flax.linen import partitioning as linen_partitioning
from flax.linen import spmd as linen_spmd
from jax.sharding import PartitionSpec

from .fmt import keypath_str

__all__ = ["Annotation", "is_box", "map_with_annotations", "path_str", "read_box", "unbox"]

_NNX_KEYS = ("out_sharding", "sharding_names", "sharding")


@dataclass(frozen=True)
class Annotation:
    """Where a leaf's spec comes from and what it says.

    ``spec`` is a tuple of logical names, or a `PartitionSpec` of mesh axes
    when ``physical``.
    """

    spec: tuple | PartitionSpec | None
    source: str
    physical: bool = False


def is_box(x: Any) -> bool:
    """Whether ``x`` is a Flax metadata box: a Linen ``nn.Partitioned`` (logical or mesh axes) or an NNX
    ``nnx.Variable``, whose value multimesh reads with its annotation."""
    return isinstance(x, (linen_meta.Partitioned, nnx.Variable))


def read_box(box: Any) -> Annotation | None:
    """The sharding annotation a Flax box carries (its axis names and where they came from), or None
    when it carries none (an NNX variable without ``out_sharding`` / ``sharding_names`` / ``sharding``)."""
    if isinstance(box, linen_spmd.LogicallyPartitioned):
        return Annotation(tuple(box.names), "flax-linen (logical)")
    if isinstance(box, linen_meta.Partitioned):
        return Annotation(PartitionSpec(*box.names), "flax-linen", physical=True)
    if isinstance(box, nnx.Variable):
        md = box.get_metadata()
        for key in _NNX_KEYS:
            names = md.get(key)
            if names is not None:
                if isinstance(names, jax.sharding.NamedSharding):
                    return Annotation(names.spec, "flax-nnx", physical=True)
                return Annotation(tuple(names), "flax-nnx")
    return None


def path_str(keypath: tuple) -> str:
    """``(DictKey('params'), DictKey('Dense_0'), ...)`` -> ``'params/Dense_0/...'``; the root is ``''``."""
    return keypath_str(keypath)


def map_with_annotations(fn: Callable[[str, Any, Annotation | None], Any], tree: Any) -> Any:
    """Map ``fn(path, leaf, annotation)`` over the array leaves of ``tree``.

    Boxes are kept: the result has the same tree structure as ``tree``.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)
    named = _axes_collections(tree)
    out = []
    for keypath, node in flat:
        path = path_str(keypath)
        if is_box(node):
            ann = read_box(node)
            out.append(jax.tree.map(lambda v, p=path, a=ann: fn(p, v, a), node))
        else:
            out.append(fn(path, node, named.annotation(path, node) if named else None))
    return jax.tree_util.tree_unflatten(treedef, out)


@dataclass(frozen=True)
class _AxesNames:
    """The names of ``params_axes`` collections: by a parameter's whole path, and by its path inside its
    collection and its shape (for trees that mirror the parameters, such as optimizer moments)."""

    by_path: dict[str, tuple]
    by_tail: dict[tuple[str, tuple], tuple]

    def annotation(self, path: str, leaf: Any) -> Annotation | None:
        names = self.by_path.get(path)
        if names is None:
            shape = tuple(getattr(leaf, "shape", ()))
            parts = path.split("/")
            names = next((self.by_tail[key] for i in range(1, len(parts))
                          if (key := ("/".join(parts[i:]), shape)) in self.by_tail), None)
        return None if names is None else Annotation(names, "flax-linen params_axes (logical)")


def _axes_collections(tree: Any) -> _AxesNames | None:
    """Every ``params_axes`` collection beside a ``params`` one in ``tree`` (T5X's `param_with_axes`)."""
    by_path: dict[str, tuple] = {}
    by_tail: dict[tuple[str, tuple], tuple] = {}

    def visit(node: Any, prefix: str) -> None:
        if not isinstance(node, Mapping):
            return
        if "params" in node and "params_axes" in node:
            specs = linen_partitioning.get_axis_names(node["params_axes"])
            params = node["params"]
            for keypath, spec in jax.tree_util.tree_flatten_with_path(
                    specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]:
                inner = path_str(keypath)
                leaf = params
                for key in inner.split("/"):
                    leaf = leaf.get(key) if isinstance(leaf, Mapping) else None
                if leaf is None or is_box(leaf):
                    continue
                names = tuple(spec)
                by_path[f"{prefix}params/{inner}"] = names
                by_tail[(inner, tuple(getattr(leaf, "shape", ())))] = names
        for key, child in node.items():
            visit(child, f"{prefix}{key}/")

    visit(tree, "")
    return _AxesNames(by_path, by_tail) if by_path else None


def unbox(tree: Any) -> Any:
    """Strip Linen boxes (NNX variables are left alone)."""
    return linen_meta.unbox(tree)
