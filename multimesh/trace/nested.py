"""Apply an equation rule inside the jaxprs an equation nests (a remat's body, a scan's, a cond's branches).

`interpret` walks one jaxpr's equations; a segment resolves its constraints
that way (`constraints.resolve_deferred`). A constraint inside a nested jaxpr
(``jax.checkpoint``, ``lax.scan``, ``lax.cond``) would be missed, and JAX
caches the traces of such bodies by function: a body shared by two tasks
(``jax.checkpoint(block)`` called in both stages) is traced once, its
constraints resolved on the first task's submesh. `rebind_nested` re-traces
each nested jaxpr that holds such a constraint through the rule, and binds
the equation with the new bodies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
from jax.core import ShapedArray
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from .._compat.jax import convert_constvars_jaxpr
from ..core.jaxprs import subjaxprs
from .interpret import bind_equation, interpret

__all__ = ["rebind_nested"]

Rule = Callable[[JaxprEqn, list], list]

#: Primitives whose nested jaxpr needs a context (manual axes) that re-tracing here would not give it.
_LEFT_AS_IS = frozenset({"shard_map"})


def _inner(value: Any) -> Jaxpr | None:
    jaxpr = getattr(value, "jaxpr", value)
    return jaxpr if isinstance(jaxpr, Jaxpr) else None


def _holds(jaxpr: Jaxpr, wanted: Callable[[JaxprEqn], bool]) -> bool:
    """Whether ``jaxpr`` (or a jaxpr nested in it) has an equation ``wanted`` picks."""
    return any(wanted(eqn) or any(_holds(inner, wanted) for inner in subjaxprs(eqn)) for eqn in jaxpr.eqns)


def _retrace(jaxpr: Jaxpr, consts: list, rule: Rule) -> ClosedJaxpr:
    inputs = [cast(ShapedArray, v.aval) for v in jaxpr.invars]  # arrays; JAX types Var.aval as their base class
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in inputs]
    return jax.make_jaxpr(lambda *args: interpret(jaxpr, consts, args, rule))(*avals)


def rebind_nested(eqn: JaxprEqn, ins: list, rule: Rule, wanted: Callable[[JaxprEqn], bool]) -> list | None:
    """``eqn`` bound on ``ins`` with each nested jaxpr that holds a ``wanted`` equation re-traced through
    ``rule``; None when it nests none (or is one whose body must stay as it is)."""
    if eqn.primitive.name in _LEFT_AS_IS:
        return None
    changed: dict[str, Any] = {}
    extra: list = []
    for name, value in eqn.params.items():
        items = value if isinstance(value, (tuple, list)) else (value,)
        if not any((inner := _inner(item)) is not None and _holds(inner, wanted) for item in items):
            continue
        new = []
        for item in items:
            inner = _inner(item)
            if inner is None or not _holds(inner, wanted):
                new.append(item)
            elif isinstance(item, ClosedJaxpr):
                new.append(_retrace(inner, item.consts, rule))
            else:  # an open jaxpr (a remat's body): its constants become leading operands
                closed = _retrace(inner, [], rule)
                if closed.consts:
                    if extra or len(items) > 1:
                        return None
                    extra = list(closed.consts)
                    new.append(convert_constvars_jaxpr(closed.jaxpr))
                else:
                    new.append(closed.jaxpr)
        changed[name] = type(value)(new) if isinstance(value, (tuple, list)) else new[0]
    if not changed:
        return None
    return bind_equation(eqn.replace(params={**eqn.params, **changed}), [*extra, *ins], mesh_in_context=True)
