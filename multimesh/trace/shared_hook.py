"""A hook into a dependency installed while any block that needs it runs: blocks may nest and run on
several threads, so the first to enter installs it and the last to leave removes it."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["SharedHook"]


class SharedHook:
    """A context manager, entered by any number of (nested, concurrent) blocks: ``install()`` on the first
    entry, ``remove()`` on the last exit."""

    def __init__(self, install: Callable[[], None], remove: Callable[[], None]) -> None:
        self._install, self._remove = install, remove
        self._depth = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._install()
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._remove()

    def __repr__(self) -> str:
        return f"SharedHook(depth={self._depth})"
