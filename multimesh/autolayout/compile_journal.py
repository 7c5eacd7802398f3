"""Compiler crashes: what a process was compiling when it died, so that its parent can say so and search on.

XLA compiles in the process that asks for a program, and a crash of its
compiler (a SIGFPE or SIGSEGV in C++) ends that process: nothing in it can
report, and a layout search dies with its first crashing candidate. So a
parent runs the compiling process with `JOURNAL_ENV` naming a directory (a
`CompileJournal`): before each compile the child writes there what it
compiles, and removes it after. When the child dies by a signal, the parent
reads what was compiling (`CompileJournal.interrupted`), reports it with the
signal, and, for a candidate of a layout search, records the crash and runs
the search again: `auto_layout` does not compile a layout recorded as
crashed, and its table shows it unpriced, with the signal
(``multimesh-train --plan --num-devices N`` does this).

Without a journal, a crash still says something: for the compile,
Python's `faulthandler` (where nothing enabled it before) writes the fatal
signal and the Python stack to the process's standard error, which the
estimate's compile otherwise sends to a temporary file
(`multimesh.estimate.compiler_log`).

`CRASH_ENV` is a test hook: a process about to compile what it names kills
itself with SIGFPE, as XLA's CPU compiler did on some layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import os
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["CRASH_ENV", "JOURNAL_ENV", "CompileJournal", "Crash", "compiling", "signal_name"]

#: The directory of the journal a parent reads when this process dies by a signal (unset: no parent reads one).
JOURNAL_ENV = "MULTIMESH_COMPILE_JOURNAL"
#: Test hook: the description of what to crash on (SIGFPE) when about to compile it.
CRASH_ENV = "MULTIMESH_TEST_CRASH_COMPILING"

_COMPILING = "compiling.json"
_CRASHES = "crashes.json"


def signal_name(number: int) -> str:
    """``SIGFPE`` for 8; ``signal 77`` for a number without a name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclasses.dataclass(frozen=True)
class Crash:
    """A compile that killed its process: ``what`` was compiled (a layout's description for a search
    ``candidate``), and the ``signal``'s name."""

    what: str
    signal: str
    candidate: bool


@dataclasses.dataclass(frozen=True)
class CompileJournal:
    """The files of one journal, in ``directory`` (shared by a parent and the processes it runs)."""

    directory: Path

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CompileJournal | None:
        path = environ.get(JOURNAL_ENV)
        return cls(Path(path)) if path else None

    @contextlib.contextmanager
    def compiling(self, what: str, candidate: bool) -> Iterator[None]:
        """Note ``what`` as compiling for the block: left behind if the process dies in it."""
        entry = self.directory / _COMPILING
        _write_json(entry, {"what": what, "candidate": candidate})
        try:
            yield
        finally:
            entry.unlink(missing_ok=True)

    def interrupted(self, signal_number: int) -> Crash | None:
        """What a process that died by ``signal_number`` was compiling (None: it was not compiling), recorded
        among the crashes when it was a search candidate."""
        entry = self.directory / _COMPILING
        if not entry.is_file():
            return None
        noted = json.loads(entry.read_text())
        entry.unlink()
        crash = Crash(noted["what"], signal_name(signal_number), bool(noted["candidate"]))
        if crash.candidate:
            _write_json(self.directory / _CRASHES, [dataclasses.asdict(c) for c in (*self.crashes().values(), crash)])
        return crash

    def crashes(self) -> dict[str, Crash]:
        """The candidates whose compile killed a process before, by description."""
        path = self.directory / _CRASHES
        if not path.is_file():
            return {}
        return {c["what"]: Crash(**c) for c in json.loads(path.read_text())}


@contextlib.contextmanager
def compiling(what: str, candidate: bool) -> Iterator[None]:
    """The block compiles ``what``: noted in this process's journal (`JOURNAL_ENV`), if a parent reads one."""
    journal = CompileJournal.from_env()
    with _fatal_signals_reported(), contextlib.nullcontext() if journal is None else journal.compiling(what, candidate):
        if os.environ.get(CRASH_ENV) == what:
            os.kill(os.getpid(), signal.SIGFPE)  # the test hook: die as a crashing compiler does
        yield


@contextlib.contextmanager
def _fatal_signals_reported() -> Iterator[None]:
    """`faulthandler` on this process's standard error for the block, unless something enabled it already."""
    if faulthandler.is_enabled():
        yield
        return
    try:
        stderr = os.fdopen(os.dup(2), "w")
    except OSError:  # no standard error
        yield
        return
    faulthandler.enable(file=stderr)
    try:
        yield
    finally:
        faulthandler.disable()
        stderr.close()


def _write_json(path: Path, value: object) -> None:
    """Whole or not at all: a reader never sees half a file."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)
