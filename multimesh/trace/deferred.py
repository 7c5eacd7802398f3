"""Logical sharding constraints whose rules are not known yet when traced.

`parallelize` traces the step once, before it knows where glue and implicit
tasks run. A logical `with_sharding_constraint` traced under its deferring
placement (`Placement.defer`) binds `logical_constraint_p`, which carries the
logical spec (and ``hint``: None, or for a Flax Linen hint the Flax rules it
saw and its fallback, see `constraints.constrain_hint`); when a segment is
compiled on its submesh, `constraints.resolve_deferred` resolves it with that
placement's rules. It is
the identity everywhere else (one-device lowering, differentiation: the
constraint applies to tangents and cotangents alike).
"""

from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["logical_constraint_p"]

logical_constraint_p = Primitive("logical_constraint")
logical_constraint_p.def_impl(lambda x, **params: x)
logical_constraint_p.def_abstract_eval(lambda x, **params: x)
mlir.register_lowering(logical_constraint_p, mlir.lower_fun(lambda x, **params: x, multiple_results=False))
ad.deflinear2(logical_constraint_p, lambda ct, x, **params: [logical_constraint_p.bind(ct, **params)])


def _batch(args, dims, **params):
    (x,), (d,) = args, dims
    if d is None:  # not mapped: JAX gives a batching rule None for an operand it does not map
        return logical_constraint_p.bind(x, **params), d
    return x, d  # the mapped dimension is not in the spec: leave the placement to the compiler


batching.primitive_batchers[logical_constraint_p] = _batch

