"""Evaluate a jaxpr equation by equation, with a per-equation rule (under a trace: re-trace it).

Two passes re-trace a step's jaxpr with a twist on some equations: the MPMD
planner inlines nested jit calls (`plan.partition.inline_calls`), and a segment
resolves deferred logical constraints with its submesh's rules
(`constraints.resolve_deferred`, through `plan.programs.run_program`). Both walk
the jaxpr here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Jaxpr, JaxprEqn, Literal

from .._compat.jax import equation_abstract_mesh, equation_context
from ..core.meshes import abstract_mesh_context

__all__ = ["bind_equation", "interpret"]

#: ``rule(eqn, inputs) -> outputs`` (a list, one per ``eqn.outvars``).
Rule = Callable[[JaxprEqn, list], Sequence[Any]]


def bind_equation(eqn: JaxprEqn, inputs: Sequence[Any], mesh_in_context: bool = False) -> list:
    """Apply ``eqn``'s primitive to ``inputs`` as the equation does (its params and context).

    ``mesh_in_context``: keep the mesh now in context (or none) rather than the one the equation was traced
    under: for an equation whose nested jaxprs were re-traced here (`nested.rebind_nested`), typed where they
    were re-traced (a pipeline stage's segment of a step traced on the whole mesh).
    """
    mesh = jax.sharding.get_abstract_mesh()
    keep = mesh_in_context and mesh != equation_abstract_mesh(eqn)
    with equation_context(eqn), (abstract_mesh_context(mesh) if keep else contextlib.nullcontext()):
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
