"""The shardings a function's own code gives its outputs, read from its jaxpr, and moved onto another mesh.

An initializer in JAX's explicit-sharding style may make its arrays inside a
`jax.jit` whose ``out_shardings`` name the model's mesh (jax-llm-examples'
``Weights.init``): the arrays come out sharded, yet `jax.eval_shape` does not
say so, because a jit's ``out_shardings`` are not part of its outputs' types.
The jaxpr holds them, as parameters of the equations that made the outputs:

* `abstract_outputs`: the function evaluated abstractly, each output carrying
  the sharding its code gives it (a jit's ``out_shardings``, a
  ``with_sharding_constraint``, a ``device_put``) where its type names none,
  and the subtrees that mirror such outputs (an optimizer's state) theirs,
  for the layouts to keep (`layout.derive_layout`, "its own sharding");
* `moved_onto`: the jaxpr with every sharding on other devices resolved on a
  placement's mesh instead, as a parameter's own sharding is: such a jit
  cannot run inside a pipeline stage's program (JAX refuses a jit inside a
  jit on other devices).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .mirror import signature
from .placement import Placement

__all__ = ["abstract_outputs", "given_shardings", "moved_onto"]

_JIT = frozenset({"jit", "pjit"})


def given_shardings(jaxpr: Jaxpr) -> list[NamedSharding | None]:
    """Per output of ``jaxpr``: the `NamedSharding` the equation that made it gives it (the ``out_shardings`` of
    a jit, inner jits followed where the outer says nothing; a sharding constraint; a ``device_put``), or None."""
    given: dict[Var, NamedSharding] = {}
    for eqn in jaxpr.eqns:
        for var, sharding in zip(eqn.outvars, _made_with(eqn)):
            if isinstance(sharding, NamedSharding):
                given[var] = sharding
    return [given.get(v) if isinstance(v, Var) else None for v in jaxpr.outvars]


def _made_with(eqn: JaxprEqn) -> Sequence[Any]:
    """The sharding ``eqn`` gives each of its outputs (None where it gives none)."""
    name = eqn.primitive.name
    if name in _JIT:
        outs = eqn.params["out_shardings"]
        if all(isinstance(s, NamedSharding) for s in outs):
            return outs
        inner = given_shardings(eqn.params["jaxpr"].jaxpr)
        return [s if isinstance(s, NamedSharding) else i for s, i in zip(outs, inner)]
    if name == "sharding_constraint":
        return [eqn.params["sharding"]]
    if name == "device_put":
        return eqn.params["devices"]
    return [None] * len(eqn.outvars)


def abstract_outputs(fun: Callable[[], Any]) -> Any:
    """``jax.eval_shape(fun)``, each output whose type names no mesh axis carrying the sharding ``fun``'s code
    gives it (`given_shardings`), or the one of the output it mirrors (`_mirrored`)."""
    closed, shapes = jax.make_jaxpr(fun, return_shape=True)()
    leaves, treedef = jax.tree.flatten(shapes)
    given = [s if not _names_axes(_type_spec(leaf)) else None for leaf, s in zip(leaves, given_shardings(closed.jaxpr))]
    given = _mirrored(shapes, given)
    out = [leaf if s is None else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s, weak_type=leaf.weak_type)
           for leaf, s in zip(leaves, given)]
    return jax.tree.unflatten(treedef, out)


def _mirrored(tree: Any, given: list) -> list:
    """``given`` (per leaf of ``tree``) extended to the subtrees that mirror a subtree whose every leaf has a
    given sharding (same structure, shapes and dtypes, and one set of shardings among such subtrees) and whose
    leaves have none: an optimizer's state made by ``zeros_like`` of such parameters. Eagerly, ``zeros_like``
    keeps an array's sharding; traced, the jit's output it reads carries none in its type."""
    if not any(s is not None for s in given):
        return given
    parts = list(_subtrees(tree, 0))
    index: dict[tuple, Any] = {}
    for sub, start, n in parts:
        shardings = given[start:start + n]
        if n and all(s is not None for s in shardings) and not _is_leaf(sub):
            key = signature(sub)
            index[key] = shardings if index.get(key, shardings) == shardings else _AMBIGUOUS
    out = list(given)
    for sub, start, n in parts:   # outermost first: a whole optimizer state before its parts
        match = index.get(signature(sub)) if n and not _is_leaf(sub) else None
        if match is not None and match is not _AMBIGUOUS and all(s is None for s in out[start:start + n]):
            out[start:start + n] = match
    return out


_AMBIGUOUS = object()


def _is_leaf(tree: Any) -> bool:
    return jax.tree_util.treedef_is_leaf(jax.tree.structure(tree))


def _subtrees(tree: Any, start: int):
    """``(subtree, index of its first leaf, its leaf count)`` for ``tree`` and each of its subtrees, outermost
    first."""
    yield tree, start, len(jax.tree.leaves(tree))
    if _is_leaf(tree):
        return
    for kid in jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)[0]:
        yield from _subtrees(kid, start)
        start += len(jax.tree.leaves(kid))


def _type_spec(leaf: Any) -> PartitionSpec | None:
    return getattr(getattr(leaf, "sharding", None), "spec", None)


def _names_axes(spec: PartitionSpec | None) -> bool:
    return isinstance(spec, PartitionSpec) and any(e is not None and e is not PartitionSpec.UNCONSTRAINED
                                                   for e in spec)


def moved_onto(closed: ClosedJaxpr, placement: Placement, what: str) -> ClosedJaxpr | None:
    """``closed`` with every `NamedSharding` and `Mesh` on other devices than ``placement``'s (nested jaxprs
    too) moved onto its mesh: a sharding's spec resolved there as a parameter's own sharding is
    (`Placement.physical`), by the array's shape where the equation gives it. None when none is on other
    devices. ``what`` names the function in errors."""
    mover = _Mover(placement, what)
    jaxpr = mover.jaxpr(closed.jaxpr)
    return ClosedJaxpr(jaxpr, closed.consts) if mover.moved else None


class _Mover:
    def __init__(self, placement: Placement, what: str):
        self.placement, self.what, self.moved = placement, what, False

    def elsewhere(self, mesh: Any) -> bool:
        """Whether ``mesh`` is a concrete mesh on other devices than the placement's (JAX refuses a jit inside
        a jit on other devices; another mesh of the same devices it takes, and so is it left)."""
        return isinstance(mesh, Mesh) and not mesh.empty and frozenset(mesh.devices.flat) != self.placement.devices

    def jaxpr(self, jaxpr: Jaxpr) -> Jaxpr:
        return jaxpr.replace(eqns=[self.eqn(e) for e in jaxpr.eqns])

    def eqn(self, eqn: JaxprEqn) -> JaxprEqn:
        ins, outs = [_shape(v) for v in eqn.invars], [_shape(v) for v in eqn.outvars]
        shapes = {"in_shardings": ins, "out_shardings": outs, "sharding": outs, "devices": ins}
        # a constraint inside the function is a hint: on a stage that lacks an axis it names, it goes without it
        hint = eqn.primitive.name == "sharding_constraint"
        params = {k: self.value(v, shapes.get(k), f"{self.what}: {eqn.primitive.name} {k}",
                                hint=hint and k == "sharding")
                  for k, v in eqn.params.items()}
        return eqn.replace(params=params)

    def value(self, value: Any, shapes: Sequence | None, where: str, hint: bool = False) -> Any:
        if isinstance(value, NamedSharding) and self.elsewhere(value.mesh):
            self.moved = True
            shape = shapes[0] if shapes else None
            spec = value.spec
            if hint:
                spec = _without_axes(spec, set(value.mesh.axis_names) - set(self.placement.mesh.axis_names),
                                     where, self.placement)
            return self.placement.physical(spec, shape, path=where)
        if self.elsewhere(value):
            self.moved = True
            return self.placement.mesh
        if isinstance(value, ClosedJaxpr):
            return ClosedJaxpr(self.jaxpr(value.jaxpr), value.consts)
        if isinstance(value, Jaxpr):
            return self.jaxpr(value)
        if type(value) in (tuple, list):
            return type(value)(self.value(v, shapes[i:i + 1] if shapes and i < len(shapes) else None, where)
                               for i, v in enumerate(value))
        return value


def _shape(var: Any) -> tuple[int, ...]:
    """A jaxpr variable's shape (a literal's or token's: none)."""
    return tuple(getattr(var.aval, "shape", ()))


def _without_axes(spec: PartitionSpec, missing: set[str], where: str, placement: Placement) -> PartitionSpec:
    """``spec`` without the mesh axes in ``missing`` (a warning names them): a constraint inside an
    initializer is a hint, which on a stage that lacks an axis applies without it."""
    named = {a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}
    dropped = sorted(named & missing)
    if not dropped:
        return spec
    warnings.warn(f"{where}: {spec} names mesh axis {', '.join(map(repr, dropped))}, which the stage "
                  f"{placement.describe()} lacks; the constraint applies there without it", stacklevel=2)

    def keep(entry: Any) -> Any:
        if isinstance(entry, tuple):
            kept = tuple(a for a in entry if a not in missing)
            return kept or None
        return None if entry in missing else entry

    return PartitionSpec(*(keep(e) for e in spec))
