"""Follow a traced step's inputs, by their paths in its arguments, into its jaxpr and the jaxprs nested in it.

A step's jaxpr takes its arguments' leaves in pytree order, so each input
variable has a path (``0.params.layers.1.q``). An equation that reads one
reads that parameter; a nested call (a jit's, a remat's, a scan's or a
custom_vjp's body) takes its equation's operands one for one, so the
parameter is followed inside. `NameStackWalk` rewrites the name stack of
every equation, nested ones too, knowing the paths each reads:
`twin_names` names the copies of NNX twins by it, `param_scopes` places
equations by the parameters they read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var

from .._compat.jax import is_name_scope, name_scope

__all__ = ["NameStackWalk", "key_name", "leaf_paths", "renamed_scopes", "with_scope"]

#: Joins the parts of a path: ``('blocks', 3, 'mlp')`` -> ``blocks.3.mlp`` (as NNX attribute paths are joined).
SEPARATOR = "."


def key_name(key: Any) -> Any:
    """An attribute name, dict key or index of a pytree key path (``GetAttrKey('blocks')`` -> ``blocks``)."""
    for field in ("name", "key", "idx"):
        if hasattr(key, field):
            return getattr(key, field)
    return key


def leaf_paths(inputs: Any) -> list[str]:
    """The path of each leaf of ``inputs`` (its jaxpr's inputs, in order): ``0.params.layers.1.q``."""
    return [SEPARATOR.join(str(key_name(k)) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(inputs)[0]]


class NameStackWalk:
    """Rewrites the name stacks of a jaxpr's equations, nested ones too, knowing the input paths each reads.

    Subclasses say how: `enter` (what a jaxpr's equations decide together, given its inputs' paths and what
    its caller decided) and `name_stack` (an equation's new name stack, or None to keep it). A body traced
    once and called several times (a jit per microbatch) is rewritten per call: its operands may differ.
    """

    def rewrite(self, closed: ClosedJaxpr, paths: Mapping[Var, str]) -> ClosedJaxpr:
        """``closed`` rewritten; ``paths`` the paths of its input variables (those not given are not followed)."""
        jaxpr = self._jaxpr(closed.jaxpr, dict(paths), None)
        return closed if jaxpr is closed.jaxpr else ClosedJaxpr(jaxpr, closed.consts)

    def enter(self, jaxpr: Jaxpr, paths: Mapping[Var, str], outer: Any) -> Any:
        """What ``jaxpr``'s equations share (handed to `name_stack`), given its callers' (``outer``)."""
        return outer

    def name_stack(self, eqn: JaxprEqn, reads: Sequence[str], context: Any) -> Any:
        """``eqn``'s new name stack (a `source_info_util.NameStack`), or None to keep its own; ``reads``: the
        paths of the inputs it reads directly, in operand order."""
        return None

    def _jaxpr(self, jaxpr: Jaxpr, paths: dict[Var, str], outer: Any) -> Jaxpr:
        context = self.enter(jaxpr, paths, outer)
        eqns = [self._eqn(eqn, paths, context) for eqn in jaxpr.eqns]
        return jaxpr.replace(eqns=eqns) if any(a is not b for a, b in zip(eqns, jaxpr.eqns)) else jaxpr

    def _eqn(self, eqn: JaxprEqn, paths: dict[Var, str], context: Any) -> JaxprEqn:
        reads = [paths[v] for v in eqn.invars if isinstance(v, Var) and v in paths]
        stack = self.name_stack(eqn, reads, context)
        params = {}
        for name, value in eqn.params.items():
            items = value if isinstance(value, (tuple, list)) else (value,)
            new = [self._inner(item, eqn, paths, context) for item in items]
            if any(a is not b for a, b in zip(new, items)):
                params[name] = type(value)(new) if isinstance(value, (tuple, list)) else new[0]
        if not params and stack is None:
            return eqn
        source_info = eqn.source_info
        if stack is not None:
            source_info = source_info.replace(name_stack=stack)
        return eqn.replace(params={**eqn.params, **params}, source_info=source_info)

    def _inner(self, item: Any, eqn: JaxprEqn, paths: dict[Var, str], context: Any) -> Any:
        inner = item.jaxpr if isinstance(item, ClosedJaxpr) else item
        if not isinstance(inner, Jaxpr):
            return item
        # A body takes the equation's operands one for one (a jit's, a remat's, a scan's); else none is followed.
        operands = eqn.invars if len(inner.invars) == len(eqn.invars) else []
        inner_paths = {v: paths[op] for v, op in zip(inner.invars, operands) if isinstance(op, Var) and op in paths}
        renamed = self._jaxpr(inner, inner_paths, context)
        if renamed is inner:
            return item
        return ClosedJaxpr(renamed, item.consts) if isinstance(item, ClosedJaxpr) else renamed


def with_scope(stack: Any, name: str) -> Any:
    """``stack`` (an equation's name stack) with the scope ``name`` innermost."""
    return source_info_util.NameStack((*stack.stack, name_scope(name)))


def renamed_scopes(stack: Any, rename: Callable[[str], str | None]) -> Any:
    """``stack`` with each scope named ``rename(name)`` (None: the scope dropped), or None when unchanged;
    transforms (``jvp``, ``transpose``) are kept."""
    out, changed = [], False
    for s in stack.stack:
        if is_name_scope(s):
            name = rename(s.name)
            changed |= name != s.name
            if name is None:
                continue
            if name != s.name:
                s = name_scope(name)
        out.append(s)
    return source_info_util.NameStack(tuple(out)) if changed else None
