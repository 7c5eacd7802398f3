"""One training run per ``out_dir``.

Two runs on one ``train.out_dir`` would both save every checkpoint (each
overwriting and pruning the other's steps) and interleave ``metrics.jsonl``.
A run holds its ``out_dir`` through a lock file naming its host and pid
(``multimesh.checkpoint.dirlock``); a second run is refused at start, before
anything is compiled, naming the holder (the CLI exits with 2). The kernel
releases the lock when the holder ends, however it ends; a lock file left by
a killed run is taken over with a message.

With several processes (one job), process 0 holds the lock for all of them:
they share the ``out_dir`` by design. When process 0 is refused, it exits
with 2 and the other processes stop as they do whenever process 0 is lost.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import jax

from multimesh.checkpoint.dirlock import DirectoryInUseError, DirectoryLock
from trainers.fit import make_out_dir

__all__ = ["RUN_LOCK", "DirectoryInUseError", "hold_out_dir", "out_dir_lock"]

#: The lock file's name in ``out_dir``.
RUN_LOCK = ".multimesh-run.lock"


def out_dir_lock(out: Path) -> DirectoryLock:
    """The lock of ``out`` (not yet taken)."""
    return DirectoryLock(
        out, what="multimesh-train", name=RUN_LOCK,
        fix="Two runs on one train.out_dir would overwrite each other's checkpoints and interleave "
            "metrics.jsonl: wait for that run to end or stop it, or give this run another train.out_dir.")


@contextlib.contextmanager
def hold_out_dir(out: Path) -> Iterator[None]:
    """Holds ``out`` (created if missing) for the run (on process 0).

    Raises:
        DirectoryInUseError: another run holds it (names its host, pid and the lock file).
    """
    if jax.process_index() != 0:
        yield
        return
    make_out_dir(out)  # a file in the way is the config's error, named as such
    lock = out_dir_lock(out)
    stale = lock.acquire()
    if stale is not None:
        print(f"multimesh-train: taking over {out} from {stale.describe()}, which ended without "
              f"releasing it", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        lock.release()
