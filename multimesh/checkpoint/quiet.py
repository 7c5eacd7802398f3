"""Keeps what a failed Orbax read or save leaves behind off stderr.

Why: when a read fails (a damaged checkpoint), Orbax 0.12's ``asyncio.gather``
returns at the first error and the other reads' coroutines and futures are
dropped. When they are finalized, which may be long after the restore has
raised, Python prints "Exception ignored in: <coroutine ...>"
(``sys.unraisablehook``) or asyncio logs "Future exception was never
retrieved", each with a page of TensorStore spec, on top of the
``CheckpointCorruptError`` that already says what is wrong.

A failed save (a full disk) makes each of Orbax's background save threads
log the error at ERROR level with its traceback (absl), pages of them before
the ``CheckpointSaveError`` that says it in one line.

A read-only manager makes Orbax warn, every time, that its directory is read
only (what the caller asked for).

``install()`` adds four narrow filters, for the life of the process: reports of
exceptions in dropped coroutines of Orbax's or TensorStore's code,
"exception was never retrieved" logs that mention Orbax, TensorStore or an OCDBT database,
Orbax's reports of failed save threads (whose error the manager raises), and
Orbax's read-only notice. Every other report goes through unchanged. (TensorStore may also print "Event loop
is closed" from its own thread when it calls back into Orbax's closed loop;
that one we cannot intercept.)
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback

_installed = False
_lock = threading.Lock()


def _mentions_orbax(text: str) -> bool:
    """Whether a report is about Orbax's reads: it names Orbax, TensorStore or TensorStore's OCDBT driver
    (a read's error raised from TensorStore's own thread has no Python frame to name the others)."""
    text = text.lower()
    return "orbax" in text or "tensorstore" in text or "ocdbt database" in text


class _DropNeverRetrieved(logging.Filter):
    """Drops asyncio's "exception was never retrieved" about Orbax's reads."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "exception was never retrieved" not in message:
            return True
        if record.exc_info and record.exc_info[1] is not None:
            message += "".join(traceback.format_exception(*record.exc_info))
        return not _mentions_orbax(message)


class _DropFailedSaveReports(logging.Filter):
    """Drops Orbax's ERROR reports, each with a traceback, of a save's failed
    background threads: ``CheckpointManager`` raises the same error to the
    caller, as one ``CheckpointSaveError``."""

    _REPORTS = ("_SignalingThread.run() raised an exception", "Handler Commit operations",
                "Save Finalize thread")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or "orbax" not in (record.pathname or ""):
            return True
        message = record.getMessage()
        return not any(r in message for r in self._REPORTS)


class _DropReadOnlyNotice(logging.Filter):
    """Drops Orbax's WARNING that a read-only manager's directory is read only,
    logged by every ``CheckpointManager(..., read_only=True)``: the caller
    asked for exactly that."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not ("orbax" in (record.pathname or "")
                    and record.getMessage().startswith("Given directory is read only="))


def _is_orbax_leftover(unraisable) -> bool:
    """An exception from a dropped coroutine of Orbax / TensorStore code."""
    obj = getattr(unraisable, "object", None)
    code = getattr(obj, "cr_code", None) or getattr(obj, "gi_code", None)
    return _mentions_orbax(getattr(code, "co_filename", "") or "")


def install() -> None:
    """Installs the filters (once; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        previous = sys.unraisablehook

        def hook(unraisable) -> None:
            if not _is_orbax_leftover(unraisable):
                previous(unraisable)

        sys.unraisablehook = hook
        logging.getLogger("asyncio").addFilter(_DropNeverRetrieved())
        logging.getLogger("absl").addFilter(_DropFailedSaveReports())
        logging.getLogger("absl").addFilter(_DropReadOnlyNotice())
        _installed = True
