"""What a checkpoint directory holds on disk, complete or not (read-only scan).

Orbax 0.12 writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it to
``<step>`` once every item is written (the commit); on object stores it marks
the commit with ``commit_success.txt`` instead. ``CheckpointManager`` relies on
Orbax for this; the scan here also reports the unfinished saves, for the
inspector and for error messages.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time

import orbax.checkpoint as ocp

#: Orbax's name for the file with per-step metadata (timestamps, item handlers).
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
#: The file Orbax writes into a step just before it commits it (the rename).
COMMIT_MARKER = "commit_success.txt"
_TMP_RE = re.compile(r"(\d+)" + re.escape(ocp.step.TMP_DIR_SUFFIX) + r".*")


@dataclasses.dataclass(frozen=True)
class StepEntry:
    """One step directory found on disk.

    Attributes:
        step: the step number.
        path: the directory.
        complete: whether Orbax committed it (a partial one is ignored by restore).
        time: commit time (or start time for a partial save), Unix seconds, if known.
        size: bytes on disk.
    """

    step: int
    path: str
    complete: bool
    time: float | None
    size: int


def scan(directory: str) -> list[StepEntry]:
    """All step directories under ``directory``, sorted by step, partial ones included."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not os.path.isdir(path):
            continue
        if name.isdigit():
            complete = bool(ocp.step.is_path_finalized(path))
            step = int(name)
        elif m := _TMP_RE.fullmatch(name):
            complete = False
            step = int(m.group(1))
        else:
            continue
        out.append(StepEntry(step, path, complete, _time(path), _size(path)))
    return sorted(out, key=lambda e: (e.step, not e.complete))


def remove_partial(directory: str, step: int, quiet_s: float = 0.5, timeout_s: float = 30.0) -> bool:
    """Removes what an unfinished save of ``step`` left (its temporary
    directory); a committed step is never touched. Returns whether nothing of
    the save is left.

    Once its Python threads have ended, a failed save may still have writes in
    flight: TensorStore finishes the writes whose caller gave up at the first
    error, creating the directories they need, so a removed directory can come
    back. Having removed something, this watches the step until nothing of it
    has appeared for ``quiet_s`` seconds, removing what comes back, for at most
    ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    removed_at = None  # when something of the step was last removed
    while True:
        left = [e.path for e in scan(directory)
                if e.step == step and not e.complete and _TMP_RE.fullmatch(os.path.basename(e.path))]
        now = time.monotonic()
        if not left and (removed_at is None or now - removed_at >= quiet_s):
            return True
        if now >= deadline:
            return not left
        for path in left:
            shutil.rmtree(path, ignore_errors=True)
        if left:
            removed_at = time.monotonic()
        time.sleep(0.02)


def is_committed(step_path: str) -> bool:
    """Whether ``step_path`` is a committed step: the final name, with Orbax's commit marker."""
    return os.path.isfile(os.path.join(step_path, COMMIT_MARKER))


def partial_steps(directory: str) -> list[int]:
    """Steps with an unfinished (uncommitted) save on disk."""
    return sorted({e.step for e in scan(directory) if not e.complete})


def _time(path: str) -> float | None:
    try:
        with open(os.path.join(path, STEP_METADATA_FILE)) as f:
            meta = json.load(f)
        ns = meta.get("commit_timestamp_nsecs") or meta.get("init_timestamp_nsecs")
        if ns:
            return ns / 1e9
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return os.path.getmtime(path)
    except OSError:
        return None


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total
