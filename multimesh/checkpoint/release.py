"""Lets Orbax's background threads of a failed save end at once.

Why: an Orbax 0.12 asynchronous save starts, besides the thread that creates
the step directory, one thread per item that first waits for a "step
directory created" signal (``_SignalingThread``). When the directory cannot be
created (the checkpoint path is a regular file, a read-only directory...), the
signal is never sent, and these non-daemon threads wait out Orbax's
coordination timeout (300 s) before the process can exit. After a failed save
we cancel the threads that save started and send the signals they wait for:
a cancelled thread returns as soon as it wakes, without running its work.

A part of a save that has failed is seen without waiting (`failure`), so
that a failed save is reported at the next check although other parts (a
large item still being written) have not ended.

The threads that did get their signal are writing the save's items: Orbax
reports the first item's error while the others may still be writing into
the step's temporary directory, so ``join`` waits for them before that
directory is removed.
"""

from __future__ import annotations

import logging
import threading
import time

from .._compat.orbax import (
    cancel_signaling_thread,
    save_part_threads,
    signaling_thread_class,
    signaling_thread_error,
)

_log = logging.getLogger(__name__)


def signaling_threads() -> set[threading.Thread]:
    """Orbax's live signal-waiting threads (empty if this Orbax has none)."""
    cls = signaling_thread_class()
    if cls is None:
        return set()
    return {t for t in threading.enumerate() if isinstance(t, cls) and t.is_alive()}


def save_parts(manager: object) -> set[threading.Thread]:
    """The threads of the parts of the Orbax manager's last asynchronous save, ended ones included."""
    return set(save_part_threads(manager))  # type: ignore[arg-type]


def failure(threads: set[threading.Thread]) -> BaseException | None:
    """The error of one of ``threads`` (`save_parts`) that has ended with one, or None: without waiting,
    and while the save's other parts may still write (Orbax reports a part's error only once every part
    before it has ended)."""
    return next((e for t in threads if (e := signaling_thread_error(t)) is not None), None)


def running(threads: set[threading.Thread]) -> bool:
    """Whether one of ``threads`` (a save's parts) still runs."""
    return any(t.is_alive() for t in threads)


def release(threads: set[threading.Thread]) -> int:
    """Cancels ``threads`` (from ``signaling_threads``) that are still alive
    and wakes them; returns how many. Never raises: it runs while another
    error is being reported."""
    released = 0
    try:
        for t in threads:
            if not t.is_alive():
                continue
            cancel_signaling_thread(t)
            released += 1
    except Exception as e:  # noqa: BLE001 - never mask the save error; pragma: no cover
        _log.warning("could not release Orbax's waiting threads after a failed save: %s", e)
    return released


def join(threads: set[threading.Thread], timeout: float) -> list[threading.Thread]:
    """Waits up to ``timeout`` seconds in all for ``threads`` to end; returns
    those still alive then."""
    deadline = time.monotonic() + timeout
    for t in threads:
        # the plain join: Orbax's join re-raises the thread's error (the one being reported)
        threading.Thread.join(t, max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]
