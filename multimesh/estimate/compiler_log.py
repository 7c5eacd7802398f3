"""What XLA says while it compiles a program for an estimate, kept with that program.

XLA's SPMD partitioner logs a warning, from C++ to the process's standard
error, when it can reshard an array only by gathering it whole on every
device and slicing it again ("Involuntary full rematerialization"): a
collective the layout did not ask for, which the compiled program runs on
every step. Printed during a layout search, a dozen such lines name no
layout. `compile_noting_reshards` compiles with file descriptor 2 sent to a
temporary file, keeps those warnings as `Reshard`s of the program, and writes
everything else back to standard error, unchanged.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Reshard", "compile_noting_reshards", "split_reshards"]

_MARK = "Involuntary full rematerialization."
_FROM_TO = re.compile(r"cannot go from sharding (?P<source>.*?) to (?P<target>\{.*?) efficiently for HLO operation "
                      r"%(?P<instruction>[\w.\-]+) = (?P<shape>\S+) ")
_OP_NAME = re.compile(r'op_name="(?P<op>[^"]*)"')
#: one redirection at a time: descriptor 2 belongs to the whole process
_REDIRECTING = threading.Lock()


@dataclass(frozen=True)
class Reshard:
    """An array XLA gathers whole on every device to reshard it: its ``shape`` per device (``f32[32,8]``), the
    ``source`` and ``target`` shardings in XLA's words, and where: the JAX operation that made it (``op``,
    e.g. ``jit(step)/transpose(jvp(jit(_take)))/scatter-add``), else the HLO ``instruction``."""

    shape: str
    source: str
    target: str
    instruction: str
    op: str = ""

    def describe(self) -> str:
        """One line: the array (its shape without XLA's layout), where it is made, and the two shardings."""
        where = self.op or ("an input of the program" if "parameter" in self.instruction else f"%{self.instruction}")
        return f"{self.shape.split('{')[0]} at {where}: from {self.source} to {self.target}"


def split_reshards(text: str) -> tuple[tuple[Reshard, ...], str]:
    """The reshard warnings in ``text`` (XLA's log), and the rest of ``text``, line by line."""
    found, rest = [], []
    for line in text.splitlines(keepends=True):
        m = _FROM_TO.search(line) if _MARK in line else None
        if m is None:
            rest.append(line)
            continue
        op = _OP_NAME.search(line[m.end():])
        found.append(Reshard(m["shape"], m["source"], m["target"], m["instruction"], op["op"] if op else ""))
    return tuple(found), "".join(rest)


@contextlib.contextmanager
def _stderr_to(file: Any) -> Iterator[None]:
    """File descriptor 2 (where C++ logs) sent to ``file`` for the block, where the process has one."""
    try:
        saved = os.dup(2)
    except OSError:  # no standard error to redirect
        yield
        return
    _flush_python_stderr()
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        _flush_python_stderr()
        os.dup2(saved, 2)
        os.close(saved)


def _flush_python_stderr() -> None:
    for stream in {id(s): s for s in (sys.stderr, sys.__stderr__) if s is not None}.values():
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def compile_noting_reshards(lowered: Any, options: dict[str, Any] | None = None) -> tuple[Any, tuple[Reshard, ...]]:
    """``lowered.compile(compiler_options=options)``, and the arrays XLA warned it reshards by gathering them
    whole."""
    with _REDIRECTING, tempfile.TemporaryFile() as log:
        try:
            with _stderr_to(log):
                compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        finally:
            log.seek(0)
            reshards, rest = split_reshards(log.read().decode(errors="replace"))
            if rest:
                _write_stderr(rest.encode())
    return compiled, reshards


def _write_stderr(data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data):]
