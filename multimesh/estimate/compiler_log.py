"""What XLA says while it compiles a program for an estimate, kept with that program.

XLA's SPMD partitioner logs a warning, from C++ to the process's standard
error, when it can reshard an array only by gathering it whole on every
device and slicing it again ("Involuntary full rematerialization"): a
collective the layout did not ask for, which the compiled program runs on
every step. Printed during a layout search, a dozen such lines name no
layout. `compile_noting_reshards` compiles with file descriptor 2 sent to a
temporary file, keeps those warnings as `Reshard`s of the program, and writes
everything else back to standard error, unchanged.

XLA says it only while compiling: a program JAX reads back from its persistent
compilation cache (``jax_compilation_cache_dir``) is not compiled, and says
nothing. So the warnings of a program compiled here are kept beside that cache
(``multimesh-reshards-<digest>.json``, keyed by the program's text, JAX's
version and the devices' kind) and read back when JAX reads the program from
the cache. A program the cache holds without them (compiled by a plain
``jax.jit`` call) has them unknown, with an `UnknownReshardsWarning` (compiling
it again in that process logs nothing either).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.monitoring

__all__ = ["Reshard", "UnknownReshardsWarning", "compile_noting_reshards", "split_reshards"]

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


def compile_noting_reshards(lowered: Any, options: dict[str, Any] | None = None, *,
                            text: str | None = None) -> tuple[Any, tuple[Reshard, ...]]:
    """``lowered.compile(compiler_options=options)``, and the arrays XLA warned it reshards by gathering them
    whole (also when JAX's persistent compilation cache holds the program: see the module's docstring).
    ``text``: ``lowered.as_text()``, where the caller has it already."""
    kept = _kept_reshards_path(lowered.as_text() if text is None else text, options)
    compiled, reshards, from_cache = _compile_noting(lowered, options)
    if not from_cache:
        if kept is not None:
            with contextlib.suppress(OSError):
                kept.write_text(json.dumps([dataclasses.asdict(r) for r in reshards]))
        return compiled, reshards
    if kept is not None and kept.is_file():
        return compiled, _read_kept(kept)
    warnings.warn("JAX read a program of this estimate from its persistent compilation cache "
                  f"({jax.config.jax_compilation_cache_dir}), compiled there by something other than an "
                  "estimate: XLA's warnings of arrays it reshards by gathering them whole (Estimate.reshards) "
                  "are not known for it. Clear that directory, or estimate with "
                  "jax.config.update('jax_enable_compilation_cache', False), to have them.",
                  UnknownReshardsWarning, stacklevel=3)
    return compiled, ()


class UnknownReshardsWarning(UserWarning):
    """An estimate's program came from JAX's persistent cache without its reshard warnings kept."""


def _compile_noting(lowered: Any, options: dict[str, Any] | None) -> tuple[Any, tuple[Reshard, ...], bool]:
    """Compile with standard error caught (the reshard warnings kept, the rest written back), and whether
    JAX read the program from its persistent cache instead of compiling it."""
    hits: list[str] = []

    def listen(event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    with _REDIRECTING, tempfile.TemporaryFile() as log:
        jax.monitoring.register_event_listener(listen)
        try:
            with _stderr_to(log):
                compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        finally:
            jax.monitoring.unregister_event_listener(listen)
            log.seek(0)
            reshards, rest = split_reshards(log.read().decode(errors="replace"))
            if rest:
                _write_stderr(rest.encode())
    return compiled, reshards, bool(hits)


def _kept_reshards_path(text: str, options: dict[str, Any] | None = None) -> Path | None:
    """Where the warnings of the program whose text is ``text`` (compiled with ``options``) are kept beside
    JAX's persistent cache; None without one."""
    cache_dir = jax.config.jax_compilation_cache_dir
    if not cache_dir or not jax.config.jax_enable_compilation_cache or "://" in str(cache_dir):
        return None
    digest = hashlib.sha256()
    for part in (jax.__version__, jax.devices()[0].device_kind, repr(sorted((options or {}).items())), text):
        digest.update(part.encode())
    return Path(cache_dir) / f"multimesh-reshards-{digest.hexdigest()[:32]}.json"


def _read_kept(path: Path) -> tuple[Reshard, ...]:
    return tuple(Reshard(**r) for r in json.loads(path.read_text()))


def _write_stderr(data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data):]
