"""Whether a function run under `microbatch` plainly returns a mean over its microbatch.

`microbatch` sums its microbatches' results, as MultiMesh does: a loss written with ``.mean()`` (divided
by the *microbatch's* size) then comes out, with its gradient, ``n`` times too large. A loss divided by
the *global* batch sums to the mean. This tells the two apart on the traced body: a scalar output made
by dividing by a constant that is the microbatch's size along the split dimension times the sizes of
some of the split leaves' other dimensions (``jnp.mean`` over ``(batch, length)`` divides by
``size * length``), not the global batch's (`microbatch` leaves out a divisor that could be either).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal

__all__ = ["mean_divisors", "per_microbatch_mean_outputs"]


def mean_divisors(shapes: Iterable[Sequence[int]], dim: int, size: int) -> set[int]:
    """The divisors of a mean over a microbatch of ``size`` rows along ``dim`` of leaves of ``shapes``: ``size``
    times the product of any of a leaf's other dimensions."""
    found = set()
    for shape in shapes:
        others = [d for k, d in enumerate(shape) if k != dim % max(len(shape), 1)]
        for r in range(len(others) + 1):
            for subset in itertools.combinations(others, r):
                found.add(size * math.prod(subset))
    return found


def per_microbatch_mean_outputs(closed: Any, divisors: set[int]) -> list[int]:
    """Indices of the scalar floating outputs of ``closed`` (a closed jaxpr) computed last by a division
    by (or a product with the inverse of) one of ``divisors``."""
    jaxpr = closed.jaxpr
    return [i for i, v in enumerate(jaxpr.outvars)
            if getattr(v.aval, "shape", None) == () and jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact)
            and _divided(jaxpr, v, divisors)]


def _divided(jaxpr: Any, var: Any, divisors: set[int], depth: int = 0) -> bool:
    if isinstance(var, Literal) or depth > 8:
        return False
    eqn = next((e for e in reversed(jaxpr.eqns) if any(o is var for o in e.outvars)), None)
    if eqn is None:
        return False
    name = eqn.primitive.name
    if name in ("pjit", "jit", "closed_call") and "jaxpr" in eqn.params:  # jnp.mean is a jit of its own
        inner = eqn.params["jaxpr"]
        inner = getattr(inner, "jaxpr", inner)
        k = next(k for k, o in enumerate(eqn.outvars) if o is var)
        return _divided(inner, inner.outvars[k], divisors, depth + 1)
    if name == "convert_element_type":
        return _divided(jaxpr, eqn.invars[0], divisors, depth + 1)
    if name in ("div", "mul") and len(eqn.invars) == 2 and isinstance(eqn.invars[1], Literal):
        value = float(eqn.invars[1].val)
        d = value if name == "div" else (1 / value if value else 0.0)
        return any(math.isclose(d, x, rel_tol=1e-6) for x in divisors if x > 1)
    return False
