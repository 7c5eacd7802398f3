"""Python's cyclic garbage collector held off while a large structure is built.

Tracing and planning a pipeline make hundreds of thousands of objects (64
microbatches: some 75,000 equations, their variables and scope stacks) that
live as long as the step. Each time allocations pass the collector's
threshold it walks them again, and its full passes walk the whole heap: a
third of a plan's time. Held off, the same collections run once, after.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["gc_paused", "without_gc"]

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off inside the block, and on again after it if it was on before."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def without_gc(fn: F) -> F:
    """``fn`` run inside `gc_paused`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
