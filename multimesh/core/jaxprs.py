"""The jaxprs an equation nests (a jit's, a remat's, a scan's body; a cond's branches)."""

from __future__ import annotations

from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr

__all__ = ["subjaxprs"]


def subjaxprs(eqn: Any) -> list[Jaxpr]:
    """Every jaxpr among ``eqn``'s parameters (closed ones opened), in parameter order."""
    out = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                out.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                out.append(item)
    return out
