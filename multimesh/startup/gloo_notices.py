"""Gloo's connection notices, kept off stdout.

Gloo (JAX's CPU collectives across processes) prints ``[Gloo] Rank r is connected to n peer ranks.
Expected number of connected peer ranks is : n`` with C++ ``std::cout``, unconditionally (pytorch/gloo
issue 462: no setting turns it off), once per communicator it builds. At a program's first run that is
a dozen lines on every process, written in the middle of a progress bar and, from the other processes,
into the terminal they share. A notice whose two counts agree says only that a connection worked; one
whose counts differ is kept.

`drop_gloo_notices` gives file descriptor 1 (where C++ writes) to a pipe read by a thread that drops
those notices (`NoticeFilter`) and writes every other line, unchanged and as soon as it ends, to where
stdout went before. Python's ``sys.stdout``, when it wrote to descriptor 1, is reopened on that
destination, so that its output (a progress bar's unfinished line included) neither waits for the
thread nor stops being a terminal (``isatty``, the terminal's width).
"""

from __future__ import annotations

import atexit
import ctypes
import io
import os
import re
import sys
import threading

__all__ = ["NoticeFilter", "drop_gloo_notices"]

_HEAD = b"[Gloo] Rank "
_ONE = re.compile(rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
                  rb"Expected number of connected peer ranks is : (\d+)")
#: the pieces ``std::cout << ...`` writes one by one; two threads' notices interleave piece by piece
_PIECES = re.compile(rb"(?:\[Gloo\] Rank |\d+| is connected to | peer ranks\. |"
                     rb"Expected number of connected peer ranks is : )+")
_installed = False
_lock = threading.Lock()


class NoticeFilter:
    """Takes Gloo's connection notices out of a byte stream fed in chunks of any size.

    The stream is passed on line by line (an unfinished line waits for its newline, or `flush`). A
    notice whose counts agree is dropped, also where it ends a line that other output began; one whose
    counts differ is kept. Notices that threads wrote at the same time come interleaved piece by piece:
    lines made of nothing but their pieces are dropped, and so are as many of the lines after them as
    they began notices beyond their own newline, where such a line is empty or holds only the rest of a
    notice (its last count, say).
    """

    def __init__(self) -> None:
        self._held = b""  # the unfinished line
        self._owed = 0  # newlines of interleaved notices still to come

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` (after what came before) may be written now: its finished lines, filtered."""
        self._held += data
        out = bytearray()
        while (end := self._held.find(b"\n")) >= 0:
            line, self._held = self._held[:end], self._held[end + 1:]
            out += self._filtered(line)
        return bytes(out)

    def flush(self) -> bytes:
        """The unfinished line, at the end of the stream."""
        held, self._held = self._held, b""
        return held

    def _filtered(self, line: bytes) -> bytes:
        """``line`` and its newline, without a notice in it (and then without the newline)."""
        if self._owed and (not line or (_HEAD not in line and _PIECES.fullmatch(line))):
            self._owed -= 1  # the rest of a notice interleaved into an earlier line, up to its newline
            return b""
        start = line.find(_HEAD)
        start = 0 if start < 0 else start  # a line of pieces may have lost its head to an earlier line
        pieces = line[start:]
        if not pieces or pieces.isdigit() or not _PIECES.fullmatch(pieces):
            return line + b"\n"
        one = _ONE.fullmatch(pieces)
        if one is not None and one.group(1) != one.group(2):
            return line + b"\n"  # fewer peers than expected: worth seeing
        if one is None:  # interleaved: each notice begun here beyond this line's own newline owes one
            self._owed = max(0, self._owed + pieces.count(_HEAD) - 1)
        return line[:start]


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _forward(read_end: int, destination: int) -> None:
    notices = NoticeFilter()
    try:
        while chunk := os.read(read_end, 1 << 16):
            _write_all(destination, notices.feed(chunk))
        _write_all(destination, notices.flush())
    except OSError:  # the destination closed (the terminal went away): nothing left to show
        pass
    finally:
        os.close(read_end)


def _writes_to_stdout_fd(stream: object) -> bool:
    try:
        return stream.fileno() == 1  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # e.g. a notebook's stream, not a file descriptor
        return False


def _reopened(old: io.TextIOWrapper, fd: int) -> io.TextIOWrapper:
    """A text stream like ``old`` (encoding, buffering) on ``fd``."""
    return io.TextIOWrapper(io.BufferedWriter(io.FileIO(fd, "w", closefd=False)), encoding=old.encoding,
                            errors=old.errors, line_buffering=old.line_buffering, write_through=old.write_through)


def _finish(destination: int, thread: threading.Thread) -> None:
    """At exit: C's buffered stdout (where ``std::cout`` goes) into the pipe, then the pipe closed, so the
    thread writes what is left and ends."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # pragma: no cover - no C library to flush
        pass
    os.dup2(destination, 1)
    thread.join(timeout=2.0)


def drop_gloo_notices() -> None:
    """Filters Gloo's connection notices out of this process's stdout from now on (once; later calls do
    nothing). Every other line goes where it went."""
    global _installed
    with _lock:
        if _installed:
            return
        for stream in (sys.stdout, sys.__stdout__):
            if stream is not None:
                stream.flush()
        try:
            destination = os.dup(1)
        except OSError:  # no stdout at all (descriptor 1 closed): nothing to keep clean
            return
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.close(write_end)
        if _writes_to_stdout_fd(sys.stdout) and isinstance(sys.stdout, io.TextIOWrapper):
            sys.stdout = _reopened(sys.stdout, destination)
        thread = threading.Thread(target=_forward, args=(read_end, destination), name="gloo-notice-filter",
                                  daemon=True)
        thread.start()
        atexit.register(_finish, destination, thread)
        _installed = True
