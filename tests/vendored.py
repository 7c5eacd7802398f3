"""Importing the vendored third-party models of ``tests/thirdparty/``: one that no longer imports on the
installed JAX or Flax skips its tests with the reason, never a collection error.

Only failures of the import itself become skips (``ImportError``, and ``AttributeError`` for a module-level
use of a name the dependency removed; for a page's cells, ``ImportError`` only); the tests' own failures stay
failures.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import flax
import jax
import pytest

T = TypeVar("T")


def import_or_skip(what: str, load: Callable[[], T],
                   errors: tuple[type[Exception], ...] = (ImportError, AttributeError)) -> T:
    """``load()`` (the vendored ``what`` imported); a skip naming ``what``, the versions and the error if the
    import fails with one of ``errors`` (at module level too: the whole file is skipped). Code run from a page
    (a guide's cells) passes ``errors=(ImportError,)``: its other errors are the test's to report."""
    try:
        return load()
    except errors as e:
        pytest.skip(f"vendored {what} does not import on jax {jax.__version__}, flax {flax.__version__}: "
                    f"{type(e).__name__}: {e}", allow_module_level=True)


@contextlib.contextmanager
def stand_ins(modules: Mapping[str, tuple[str, tuple[str, ...]]]) -> Iterator[None]:
    """While importing a vendored model: each ``name -> (why, functions)`` of ``modules`` that this JAX lacks is
    a stand-in module whose ``functions`` raise ``NotImplementedError`` saying ``why`` (for a kernel the
    model imports but the tests never run); removed from ``sys.modules`` afterwards."""
    added = []
    for name, (why, functions) in modules.items():
        try:
            __import__(name)
            continue
        except ImportError:
            pass
        module = types.ModuleType(name, f"a stand-in: {why}")
        for function in functions:
            setattr(module, function, _unavailable(f"{name}.{function}", why))
        sys.modules[name] = module
        added.append(name)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _unavailable(name: str, why: str) -> Callable:
    def unavailable(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"{name} is a stand-in: {why}")
    return unavailable
