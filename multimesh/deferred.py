"""Logical sharding constraints whose rules are not known yet when traced.

Under MPMD the whole step is traced once, before the partitioner decides
where glue and implicit tasks run. A logical `with_sharding_constraint`
traced then binds `logical_constraint_p`, which carries the logical spec; when
a segment is compiled on its submesh, `eval_with_scope` resolves it with that
placement's rules. It is the identity everywhere else (one-device lowering,
differentiation: the constraint applies to tangents and cotangents alike).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec

from .interpret import bind_equation, interpret
from .scope import Scope, use_scope

__all__ = ["logical_constraint_p", "deferring", "is_deferring", "eval_with_scope"]

logical_constraint_p = Primitive("logical_constraint")
logical_constraint_p.def_impl(lambda x, *, spec: x)
logical_constraint_p.def_abstract_eval(lambda x, *, spec: x)
mlir.register_lowering(logical_constraint_p, mlir.lower_fun(lambda x, *, spec: x, multiple_results=False))
ad.deflinear2(logical_constraint_p, lambda ct, x, *, spec: [logical_constraint_p.bind(ct, spec=spec)])


def _batch(args, dims, *, spec):
    (x,), (d,) = args, dims
    if d is batching.not_mapped:
        return logical_constraint_p.bind(x, spec=spec), d
    return x, d  # the mapped dimension is not in the spec: leave the placement to the compiler


batching.primitive_batchers[logical_constraint_p] = _batch

_DEFER: contextvars.ContextVar[bool] = contextvars.ContextVar("multimesh_defer_constraints", default=False)


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    token = _DEFER.set(True)
    try:
        yield
    finally:
        _DEFER.reset(token)


def is_deferring() -> bool:
    return _DEFER.get()


def eval_with_scope(closed: ClosedJaxpr, scope: Scope, *args: Any) -> Sequence[Any]:
    """Evaluate ``closed`` (under a trace: re-trace it), resolving deferred constraints with ``scope``."""
    from .constraints import with_sharding_constraint

    def resolve(eqn: Any, ins: list) -> list:
        if eqn.primitive is logical_constraint_p:
            return [with_sharding_constraint(ins[0], PartitionSpec(*eqn.params["spec"]))]
        return bind_equation(eqn, ins)

    with use_scope(scope):
        return interpret(closed.jaxpr, closed.consts, args, resolve)
