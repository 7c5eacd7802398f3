"""A misspelt keyword argument named with the parameters closest to it (Python's own TypeError does not).

``@keyword_hints`` on a function with an explicit signature checks each call's arguments against it before
the call: ``parallelize(step, mseh=...)`` raises ``TypeError: parallelize() got an unexpected keyword
argument 'mseh'; did you mean 'mesh'?``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["keyword_hints", "unknown_keyword_error"]

P = ParamSpec("P")
R = TypeVar("R")


def keyword_hints(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, its calls with a keyword it does not take refused with the closest of its parameter names."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return fn  # every keyword is taken
    keywords = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        unknown = [k for k in kwargs if k not in keywords]
        if unknown:
            raise unknown_keyword_error(fn.__name__, unknown, keywords)
        return fn(*args, **kwargs)

    return checked


def unknown_keyword_error(function: str, unknown: list[str], keywords: list[str]) -> TypeError:
    """Python's message for keywords ``unknown``, each followed by the closest of ``keywords`` (or, when none
    is close, the list of them)."""
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, keywords, n=2, cutoff=0.6)
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"it takes {', '.join(keywords)}"
        parts.append(f"{function}() got an unexpected keyword argument {name!r}; {hint}")
    return TypeError("\n".join(parts))
