"""Collective axis names from ``jax.pmap`` code, given their one-device meaning.

Models written for ``jax.pmap`` name its axis inside: Flax's ImageNet
ResNet builds ``nn.BatchNorm(axis_name="batch")``, which averages its batch
statistics with ``lax.pmean(..., "batch")``; pmap-era training steps do the
same with their gradients. Under ``jax.jit`` no such name is bound, and JAX
raises ``NameError: Found an unbound axis name: batch``.

`parallelize` is given the step one device runs, and one device running pmap
code is ``jax.pmap`` over one device: each such axis has size 1, and a
collective over it returns its operand (``pmean``, ``psum``, ``pmax``, and
``all_gather`` with a leading axis of 1). The sharded step computes on the
global batch, as that one device does, so its statistics and gradients are
already the whole batch's: the same values that the pmap program on ``n``
devices gets by averaging ``n`` equal shards. `with_axes_of_one` binds the
names that way (``jax.vmap`` of size 1 over no argument), `unbound_axis`
reads the name a trace lacked from JAX's error, and `step_context.traced_in_context`
traces a step again with each such name bound (`parallelize` and `mjit` do). A task's body, which multimesh
traces into a jaxpr of its own inside the step's trace, is bound the same way
(`axes_of_one_in_force`): a collective traced there, e.g. under the ``jax.vjp``
of a task's forward pass, would otherwise stay in that jaxpr, over an axis no
program has.
"""

from __future__ import annotations

import contextvars
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["axes_of_one_in_force", "unbound_axis", "with_axes_of_one"]

_UNBOUND = re.compile(r"unbound axis name: (?P<name>[^\s.,;]+)")
_IN_FORCE: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("axes_of_one", default=())


def unbound_axis(error: BaseException) -> str | None:
    """The axis name JAX found unbound, when ``error`` is that error (a ``NameError``), else None."""
    if not isinstance(error, NameError):
        return None
    m = _UNBOUND.search(str(error))
    return m["name"] if m else None


def with_axes_of_one(fun: Callable, names: Sequence[str]) -> Callable:
    """``fun`` with each of ``names`` bound as an axis of size 1: collectives over it act as on one device.
    Its arguments and results are not mapped; keyword arguments are passed through."""

    @functools.wraps(fun)
    def bound(*args: Any, **kwargs: Any) -> Any:
        call = functools.partial(fun, **kwargs) if kwargs else fun
        for name in names:
            call = jax.vmap(call, in_axes=None, out_axes=None, axis_size=1, axis_name=name)
        token = _IN_FORCE.set(tuple(dict.fromkeys((*_IN_FORCE.get(), *names))))
        try:
            return call(*args)
        finally:
            _IN_FORCE.reset(token)

    bound.axes_of_one = tuple(names)  # type: ignore[attr-defined]
    return bound


def axes_of_one_in_force() -> tuple[str, ...]:
    """The axis names `with_axes_of_one` binds around the code running now (none outside it)."""
    return _IN_FORCE.get()
