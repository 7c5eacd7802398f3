"""Evaluate a jaxpr equation by equation, with a per-equation rule (under a trace: re-trace it).

Two passes re-trace a step's jaxpr with a twist on some equations: the MPMD
planner inlines nested jit calls (`plan.partition.inline_calls`), and a segment
resolves deferred logical constraints with its submesh's rules
(`constraints.resolve_deferred`, through `plan.programs.run_program`). Both walk
the jaxpr here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.extend.core import Jaxpr, JaxprEqn, Literal

__all__ = ["bind_equation", "interpret"]

#: ``rule(eqn, inputs) -> outputs`` (a list, one per ``eqn.outvars``).
Rule = Callable[[JaxprEqn, list], Sequence[Any]]


def bind_equation(eqn: JaxprEqn, inputs: Sequence[Any]) -> list:
    """Apply ``eqn``'s primitive to ``inputs`` as the equation does (its params and context)."""
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def interpret(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], rule: Rule = bind_equation) -> list:
    """The outputs of ``jaxpr`` on ``args``, each equation evaluated by ``rule``."""
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, rule(eqn, [read(v) for v in eqn.invars])))
    return [read(v) for v in jaxpr.outvars]
