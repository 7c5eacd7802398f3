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
from .precision import dot_dtype

__all__ = ["matmul_flops", "matmul_flops_by_dtype"]


def _dot_flops(eqn: Any) -> float:
    """2 x (output elements) x (contracted elements) of a ``dot_general``."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    contracted = math.prod(lhs[d] for d in lhs_contract)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted


def matmul_flops(jaxpr: Any) -> float:
    """Flops of every ``dot_general`` in ``jaxpr`` (`matmul_flops_by_dtype`, all dtypes together)."""
    return sum(matmul_flops_by_dtype(jaxpr).values())


def _add(into: dict[str, float], more: dict[str, float], times: float = 1.0) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0.0) + times * v


def matmul_flops_by_dtype(jaxpr: Any) -> dict[str, float]:
    """Flops of every ``dot_general`` in ``jaxpr`` (a `Jaxpr` or `ClosedJaxpr`) and the jaxprs it nests, by
    the dtype its operands run in (`precision.dot_dtype`: bf16 operands accumulated in f32 are bfloat16),
    over the whole (global) arrays: a ``scan`` body counted ``length`` times, a ``while`` body once (its
    trip count is not known before it runs), a ``cond`` as its costliest branch, a ``shard_map`` body (its
    per-device shapes) once per device of its mesh."""
    total: dict[str, float] = {}
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            dtype = dot_dtype(eqn.invars[0].aval.dtype.name, eqn.invars[1].aval.dtype.name,
                              eqn.params.get("precision"))
            _add(total, {dtype: _dot_flops(eqn)})
            continue
        inner = [matmul_flops_by_dtype(j) for j in subjaxprs(eqn)]
        if not inner:
            continue
        if name == "cond":
            _add(total, max(inner, key=lambda d: sum(d.values())))
            continue
        times = eqn.params["length"] if name == "scan" else eqn.params["mesh"].size if name == "shard_map" else 1
        for d in inner:
            _add(total, d, times)
    return total

