"""Command-line inspector for checkpoint directories.

    python -m multimesh.checkpoint.inspect DIR          # list the steps
    python -m multimesh.checkpoint.inspect DIR STEP     # one step: tree + metadata
    multimesh-ckpt DIR [STEP|latest]

Leaf paths are printed as ``step_fn.report()`` and the trainer's
``sharding.txt`` spell them (a Flax box's ``params/Dense_0/kernel``, not the
key path through its ``value`` attribute); ``restore(path=...)`` takes them.

Reads only; never creates, changes or deletes anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence

from ..core.fmt import format_bytes
from . import ondisk
from .errors import CheckpointCorruptError
from .tree import sharding_str


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Plain-text table with a header rule; ``right`` lists right-aligned columns."""
    widths = [len(h) for h in headers]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]

    def line(cells):
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _when(t: float | None) -> str:
    if t is None:
        return "?"
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def list_steps(directory: str) -> str:
    """The listing of ``directory``: step, status, time, size of every step dir."""
    entries = ondisk.scan(directory)
    if not entries:
        return f"no checkpoints in {directory}"
    rows = []
    for e in entries:
        status = "complete" if e.complete else "partial (ignored)"
        rows.append([str(e.step), status, _when(e.time), format_bytes(e.size), os.path.basename(e.path)])
    complete = [e.step for e in entries if e.complete]
    table = format_table(["step", "status", "time (UTC)", "size", "directory"], rows, right=(0, 3))
    latest = f"latest complete step: {complete[-1]}" if complete else "no complete step"
    return f"checkpoints in {directory}\n\n{table}\n\n{latest}"


def describe_step(directory: str, step: int | None) -> str:
    """Details of one complete step: saved tree, meshes, metadata, data position."""
    from .manager import CheckpointManager  # imports JAX/Orbax only when needed

    with CheckpointManager(directory, read_only=True) as mgr:
        info = mgr.info(step)
    entry = next((e for e in ondisk.scan(directory) if e.step == info.step and e.complete), None)
    lines = [f"checkpoint step {info.step} in {info.path}"]
    if entry is not None:
        lines.append(f"  committed {_when(entry.time)} UTC, {format_bytes(entry.size)} on disk")
    v = info.versions
    lines.append(
        f"  written by multimesh {v.get('multimesh', '?')}, jax {v.get('jax', '?')}, "
        f"orbax-checkpoint {v.get('orbax-checkpoint', '?')}, {info.process_count} process(es)")
    lines.append("")
    lines.append("meshes:")
    if info.meshes:
        lines += [f"  mesh{i}: {m.describe()}" for i, m in enumerate(info.meshes)]
    else:
        lines.append("  (none: no leaf has a NamedSharding)")
    lines.append("")
    total = sum(r.nbytes for r in info.leaves)
    lines.append(f"tree: {len(info.leaves)} leaves, {format_bytes(total)}")
    # names, not full key paths: a boxed leaf reads as in step_fn.report() and sharding.txt
    rows = [[r.name, str(r.shape), r.dtype, sharding_str(r.sharding), r.checksum or "-"]
            for r in info.leaves]
    lines.append(format_table(["path", "shape", "dtype", "saved sharding", "checksum"], rows))
    lines.append("")
    lines.append("data position: " + json.dumps(info.data_position))
    lines.append("metadata:")
    lines += ["  " + s for s in json.dumps(info.metadata, indent=2, sort_keys=True).splitlines()]
    return "\n".join(lines)


def _quiet_orbax() -> None:
    """Orbax logs warnings through absl (e.g. about read-only mode); the CLI's
    output is the table, so keep only errors."""
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # pragma: no cover - absl comes with Orbax
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``multimesh-ckpt``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="multimesh-ckpt",
        description="List the checkpoints in DIR, or describe one step.")
    parser.add_argument("directory", help="checkpoint directory")
    parser.add_argument("step", nargs="?", help="a step number, or 'latest'")
    args = parser.parse_args(argv)
    _quiet_orbax()
    directory = os.path.abspath(os.path.expanduser(args.directory))
    if not os.path.isdir(directory):
        print(f"multimesh-ckpt: error: no such directory: {directory}", file=sys.stderr)
        return 2
    inner = os.path.join(directory, "checkpoints")
    if not ondisk.scan(directory) and os.path.isdir(inner):  # a trainer's run directory: read its checkpoints
        print(f"multimesh-ckpt: {directory} is a run directory; reading {inner}", file=sys.stderr)
        directory = inner
    try:
        if args.step is None:
            print(list_steps(directory))
        else:
            step = None if args.step == "latest" else int(args.step)
            print(describe_step(directory, step))
    except ValueError as e:
        if args.step is not None and not args.step.isdigit() and args.step != "latest":
            print(f"multimesh-ckpt: error: STEP must be a number or 'latest', got {args.step!r}",
                  file=sys.stderr)
            return 2
        print(f"multimesh-ckpt: error: {e}", file=sys.stderr)
        return 1
    except (FileNotFoundError, CheckpointCorruptError) as e:
        print(f"multimesh-ckpt: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
