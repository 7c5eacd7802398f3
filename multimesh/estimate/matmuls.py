"""The flops of a program's matrix products, counted from its traced jaxpr.

XLA's cost analysis of a compiled program misses some of them: a loop's body
(a `scan`: a model's scanned layers) counts once whatever its trip count, and
on a GPU the products that became library calls (cuBLAS) count nothing. The
jaxpr has every product with its shapes, and every loop with its length, so
its count is exact for the matrix work, which dominates a model's flops.
A grouped product (``ragged_dot_general``: a Mixture of Experts' experts)
counts each row through its one group, as a grouped GEMM computes it;
`grouped_products` lists them with the bytes a grouped GEMM moves (its
operands and result once), what `timing` charges in place of the dense
product XLA:CPU makes of one (`grouped`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core.jaxprs import subjaxprs
from .precision import dot_dtype

__all__ = ["GroupedProduct", "grouped_products", "matmul_flops", "matmul_flops_by_dtype"]


def _dot_flops(eqn: Any) -> float:
    """2 x (output elements) x (contracted elements) of a ``dot_general``."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    contracted = math.prod(lhs[d] for d in lhs_contract)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted


def _ragged_dot_flops(eqn: Any) -> float:
    """A grouped product's flops: each row of ``lhs`` through its own group only. Where the ragged dimension is
    contracted (a gradient of the groups' weights) the output holds one block per group, each of which sums
    only its own rows: the dense count over the output divided by the number of groups."""
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (lhs_contract, _), _ = numbers.dot_dimension_numbers
    lhs = eqn.invars[0].aval.shape
    groups = eqn.invars[2].aval.shape[-1]
    dense = 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
    ragged_contracted = any(d in lhs_contract for d in numbers.lhs_ragged_dimensions)
    return dense / groups if ragged_contracted else dense


_PRODUCTS = {"dot_general": _dot_flops, "ragged_dot_general": _ragged_dot_flops}


def matmul_flops(jaxpr: Any) -> float:
    """Flops of every ``dot_general`` and ``ragged_dot_general`` in ``jaxpr`` (`matmul_flops_by_dtype`, all dtypes
    together)."""
    return sum(matmul_flops_by_dtype(jaxpr).values())


def _add(into: dict[str, float], more: dict[str, float], times: float = 1.0) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0.0) + times * v


def matmul_flops_by_dtype(jaxpr: Any) -> dict[str, float]:
    """Flops of every ``dot_general`` and grouped ``ragged_dot_general`` in ``jaxpr`` (a `Jaxpr` or `ClosedJaxpr`)
    and the jaxprs it nests, by
    the dtype its operands run in (`precision.dot_dtype`: bf16 operands accumulated in f32 are bfloat16),
    over the whole (global) arrays: a ``scan`` body counted ``length`` times, a ``while`` body once (its
    trip count is not known before it runs), a ``cond`` as its costliest branch, a ``shard_map`` body (its
    per-device shapes) once per device of its mesh."""
    total: dict[str, float] = {}
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        name = eqn.primitive.name
        if name in _PRODUCTS:
            dtype = dot_dtype(eqn.invars[0].aval.dtype.name, eqn.invars[1].aval.dtype.name,
                              eqn.params.get("precision"))
            _add(total, {dtype: _PRODUCTS[name](eqn)})
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



@dataclass(frozen=True)
class GroupedProduct:
    """One grouped product (``ragged_dot_general``) as a grouped GEMM runs it, over the whole (global) arrays of
    one execution: ``flops`` (each row through its own group), ``bytes`` (its operands, group sizes and result,
    each once), the ``dtype`` its operands run in, and ``count``: executions per program run (a ``scan``'s
    length)."""

    flops: float
    bytes: int
    dtype: str
    count: int = 1


def _nbytes(v: Any) -> int:
    return int(math.prod(v.aval.shape)) * v.aval.dtype.itemsize


def grouped_products(jaxpr: Any, times: int = 1, devices: int = 1) -> tuple[GroupedProduct, ...]:
    """Every grouped product of ``jaxpr`` and the jaxprs it nests (`GroupedProduct`), counted as
    `matmul_flops_by_dtype` counts them: a ``scan`` body ``length`` times (in ``count``), a ``shard_map`` body's
    per-device shapes times the devices of its mesh, every branch of a ``cond``."""
    found: list[GroupedProduct] = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        name = eqn.primitive.name
        if name == "ragged_dot_general":
            dtype = dot_dtype(eqn.invars[0].aval.dtype.name, eqn.invars[1].aval.dtype.name,
                              eqn.params.get("precision"))
            moved = sum(_nbytes(v) for v in (*eqn.invars[:3], *eqn.outvars))
            found.append(GroupedProduct(_ragged_dot_flops(eqn) * devices, moved * devices, dtype, times))
            continue
        inner_times = times * (eqn.params["length"] if name == "scan" else 1)
        inner_devices = devices * (eqn.params["mesh"].size if name == "shard_map" else 1)
        for j in subjaxprs(eqn):
            found.extend(grouped_products(j, inner_times, inner_devices))
    return tuple(found)
