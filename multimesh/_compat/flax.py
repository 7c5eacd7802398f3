"""Flax internals used by multimesh (tested: the suite on flax 0.12.12, its smoke subset on 0.12.7).

Linen has no public hook for routing its logical constraints nor for the module being run; these
functions are the only places multimesh touches Flax below its public API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax.core import meta as _flax_meta
from flax.linen import spmd as _linen_spmd

__all__ = ["linen_constraint_functions", "running_linen_module", "set_linen_constraint_functions"]


def linen_constraint_functions() -> tuple[Callable, Callable, Callable, Callable]:
    """The four functions through which Linen constrains: ``nn.with_logical_constraint`` looks up two of
    ``flax.linen.spmd`` when called, ``get_logical_axis_rules`` (the rules in force) and
    ``_with_sharding_constraint_one_fallback`` (constrain one leaf); and a boxed parameter is constrained
    where a module reads it by its box's ``unbox`` (``flax.core.meta.Partitioned.unbox``,
    ``flax.linen.spmd.LogicallyPartitioned.unbox``).

    Public replacement: none (a hook in ``with_logical_constraint`` and in unboxing for resolving names, or
    a rules context that also takes the mesh to resolve on, would replace all four). Tested on flax 0.12.12
    and 0.12.7.
    """
    return (_linen_spmd.get_logical_axis_rules, _linen_spmd._with_sharding_constraint_one_fallback,
            _flax_meta.Partitioned.unbox, _linen_spmd.LogicallyPartitioned.unbox)


def set_linen_constraint_functions(rules: Callable, constrain_leaf: Callable, unbox_partitioned: Callable,
                                   unbox_logical: Callable) -> None:
    """Replaces the four functions of `linen_constraint_functions` (for every thread) with these, which take
    the same arguments.

    Public replacement: none (see `linen_constraint_functions`). Tested on flax 0.12.12 and 0.12.7.
    """
    _linen_spmd.get_logical_axis_rules = rules
    _linen_spmd._with_sharding_constraint_one_fallback = constrain_leaf
    _flax_meta.Partitioned.unbox = unbox_partitioned  # type: ignore[method-assign]
    _linen_spmd.LogicallyPartitioned.unbox = unbox_logical  # type: ignore[method-assign]


def running_linen_module() -> Any:
    """The Linen module whose method (``setup``, ``__call__``, an initializer it calls) is running in this
    thread, or None (``flax.linen.module._context.module_stack``).

    Public replacement: none (a module's own code has ``self``; an initializer called by it has not).
    Tested on flax 0.12.12.
    """
    from flax.linen.module import _context

    stack = _context.module_stack
    return stack[-1] if stack else None
