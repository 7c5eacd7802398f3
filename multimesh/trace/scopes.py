"""The scope stack a trace is under, across the `jax.jit` that `microbatch` wraps its body in.

`microbatch` traces its function once, as one `jax.jit`, and calls it for
every microbatch (so the model is traced and differentiated once, not once
per microbatch). JAX starts a jit's trace with an empty name stack, so inside
that body the scopes around the `microbatch` call (a registered
`jax.named_scope`, say) and the microbatch index are not on JAX's stack.
This module keeps them: `scope_stack` is what a trace-time lookup (a
registered task's scope, its mesh slice) should read, and
`microbatch_iterations` the iterations the body being traced stands for.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

from jax.extend import source_info_util

__all__ = ["microbatch_body", "microbatch_iterations", "scope_stack"]

_OUTER: contextvars.ContextVar[tuple] = contextvars.ContextVar("multimesh_outer_scopes", default=(None, ()))


def scope_stack() -> str:
    """The name stack being traced, with the scopes outside an enclosing `microbatch` body in front."""
    outer, _ = _OUTER.get()
    inner = str(source_info_util.current_name_stack())
    if not outer:
        return inner
    return f"{outer}/{inner}" if inner else outer


def microbatch_iterations() -> Sequence[int]:
    """The `microbatch` iterations the body being traced is called for (empty outside one)."""
    return _OUTER.get()[1]


@contextlib.contextmanager
def microbatch_body(outer: str, iterations: Sequence[int]) -> Iterator[None]:
    """Trace a `microbatch` body: ``outer`` is the scope stack around the `microbatch` call."""
    token = _OUTER.set((outer, tuple(iterations)))
    try:
        yield
    finally:
        _OUTER.reset(token)
