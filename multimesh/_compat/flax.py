"""Flax internals used by multimesh (tested: the suite on flax 0.12.12, its smoke subset on 0.12.7).

Linen has no public hook for routing its logical constraints nor for the module being run; these
functions are the only places multimesh touches Flax below its public API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax.linen import spmd as _linen_spmd

__all__ = ["linen_constraint_functions", "running_linen_module", "set_linen_constraint_functions"]


def linen_constraint_functions() -> tuple[Callable, Callable]:
    """The two functions of ``flax.linen.spmd`` that ``nn.with_logical_constraint`` looks up when called:
    ``get_logical_axis_rules`` (the rules in force) and ``_with_sharding_constraint_one_fallback``
    (constrain one leaf).

    Public replacement: none (a hook in ``with_logical_constraint`` for resolving names, or a rules
    context that also takes the mesh to resolve on, would replace both). Tested on flax 0.12.12.
    """
    return _linen_spmd.get_logical_axis_rules, _linen_spmd._with_sharding_constraint_one_fallback


def set_linen_constraint_functions(rules: Callable, constrain_leaf: Callable) -> None:
    """Replaces the two functions of `linen_constraint_functions` (in ``flax.linen.spmd``, for every thread)
    with ``rules`` and ``constrain_leaf``, which take the same arguments.

    Public replacement: none (see `linen_constraint_functions`). Tested on flax 0.12.12.
    """
    _linen_spmd.get_logical_axis_rules = rules
    _linen_spmd._with_sharding_constraint_one_fallback = constrain_leaf


def running_linen_module() -> Any:
    """The Linen module whose method (``setup``, ``__call__``, an initializer it calls) is running in this
    thread, or None (``flax.linen.module._context.module_stack``).

    Public replacement: none (a module's own code has ``self``; an initializer called by it has not).
    Tested on flax 0.12.12.
    """
    from flax.linen.module import _context

    stack = _context.module_stack
    return stack[-1] if stack else None
