"""The leaves of a pytree that are not arrays, by path: what a traced function may not take or return."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .fmt import keypath_str

__all__ = ["is_array", "non_arrays"]


def is_array(x: Any) -> bool:
    """An array or a number: what JAX can trace (tracers are ``jax.Array`` too)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)) or hasattr(x, "__jax_array__")


def non_arrays(tree: Any, what: str) -> str:
    """``""``, or ``"N value(s) that are not arrays (<what> <path>: <type> <repr>; ...)"`` (the first five)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    bad = [(keypath_str(p, root="(the whole tree)"), x) for p, x in leaves if not is_array(x)]
    if not bad:
        return ""
    shown = "; ".join(f"{what} {p}: {type(x).__name__} {x!r:.60}" for p, x in bad[:5])
    return f"{len(bad)} value(s) that are not arrays ({shown})"
