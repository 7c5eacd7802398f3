"""The flops of a program's matrix products, counted from its traced jaxpr.

XLA's cost analysis of a compiled program misses some of them: a loop's body
(a `scan`: a model's scanned layers) counts once whatever its trip count, and
on a GPU the products that became library calls (cuBLAS) count nothing. The
jaxpr has every product with its shapes, and every loop with its length, so
its count is exact for the matrix work, which dominates a model's flops.
"""

from __future__ import annotations

import math
from typing import Any

from ..core.jaxprs import subjaxprs

__all__ = ["matmul_flops"]


def _dot_flops(eqn: Any) -> float:
    """2 x (output elements) x (contracted elements) of a ``dot_general``."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    contracted = math.prod(lhs[d] for d in lhs_contract)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted


def matmul_flops(jaxpr: Any) -> float:
    """Flops of every ``dot_general`` in ``jaxpr`` (a `Jaxpr` or `ClosedJaxpr`) and the jaxprs it nests,
    over the whole (global) arrays: a ``scan`` body counted ``length`` times, a ``while`` body once (its
    trip count is not known before it runs), a ``cond`` as its costliest branch, a ``shard_map`` body (its
    per-device shapes) once per device of its mesh."""
    total = 0.0
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_flops(eqn)
            continue
        inner = [matmul_flops(j) for j in subjaxprs(eqn)]
        if not inner:
            continue
        if name == "cond":
            total += max(inner)
        elif name == "scan":
            total += eqn.params["length"] * sum(inner)
        elif name == "shard_map":
            total += eqn.params["mesh"].size * sum(inner)
        else:
            total += sum(inner)
    return total
