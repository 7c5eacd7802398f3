"""One writer per directory: an advisory lock file that names its holder.

Why: two jobs writing one checkpoint directory (or one training ``out_dir``)
overwrite and delete each other's steps (Orbax saves with ``force=True`` and
prunes with ``max_to_keep``), and both believe they succeeded. A
``DirectoryLock`` is held by one writer; a second one is refused with the
holder's host, pid and the lock's path.

The lock is ``flock(2)`` on a file in the directory: the kernel drops it when
the holder's process ends, however it ends, so a lock left by a killed job is
never mistaken for a live one. The file also records who holds it (host,
pid, what, since); finding a record while acquiring the lock means the last
holder ended without releasing it (a stale lock), which ``acquire`` reports.
Separate ``DirectoryLock`` objects exclude each other even within one process
(each has its own open file). On network filesystems ``flock`` is as good as
the filesystem's locking (NFS emulates it with byte-range locks).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket

__all__ = ["DirectoryInUseError", "DirectoryLock", "LockHolder"]


@dataclasses.dataclass(frozen=True)
class LockHolder:
    """Who holds (or held) a lock: ``what`` (e.g. ``"multimesh-train"``), host, pid, since (ISO UTC)."""

    what: str
    host: str
    pid: int
    since: str

    def describe(self) -> str:
        here = " (this process)" if self.is_this_process() else ""
        return f"{self.what} on host {self.host}, pid {self.pid}{here}, since {self.since}"

    def is_this_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LockHolder | None:
        try:
            d = json.loads(text)
            return cls(str(d["what"]), str(d["host"]), int(d["pid"]), str(d["since"]))
        except (ValueError, KeyError, TypeError):
            return None  # empty (a holder that has not written yet) or foreign content


class DirectoryInUseError(BlockingIOError):
    """Another writer holds the directory's lock.

    Attributes:
        directory: the directory.
        lock_path: the lock file.
        holder: who holds it (``None`` when it has not recorded itself yet).
    """

    def __init__(self, directory: str, lock_path: str, holder: LockHolder | None, fix: str):
        self.directory = directory
        self.lock_path = lock_path
        self.holder = holder
        who = holder.describe() if holder is not None else "another process (not yet recorded)"
        self._message = f"{directory} is in use by {who}; lock file {lock_path}. {fix}"
        super().__init__(errno.EWOULDBLOCK, self._message)

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 11]"
        return self._message


class DirectoryLock:
    """An exclusive lock on ``directory``, held through the file ``directory/name``.

    Args:
        directory: the directory to hold (must exist when acquiring).
        what: how the holder is named to others (``"multimesh-train"``).
        name: the lock file's name inside ``directory``.
        fix: what the refused writer should do (ends the refusal's message).
    """

    def __init__(self, directory: str | os.PathLike, *, what: str, name: str, fix: str):
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, name)
        self.what = what
        self.fix = fix
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> LockHolder | None:
        """Takes the lock, or raises ``DirectoryInUseError`` at once (never waits).

        Returns the previous holder when its lock was stale (it ended without
        releasing), for the caller to report; ``None`` otherwise. Raises
        ``OSError`` when the lock file cannot be created (no such directory,
        read-only, not a directory).
        """
        if self._fd is not None:
            return None
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = LockHolder.from_json(_read(fd))
                os.close(fd)
                raise DirectoryInUseError(self.directory, self.path, holder, self.fix) from None
            except BaseException:
                os.close(fd)
                raise
            # a releasing holder unlinks the file before it unlocks: if the file we
            # locked is no longer the one at the path, lock the new one instead
            if not _same_file(fd, self.path):
                os.close(fd)
                continue
            stale = LockHolder.from_json(_read(fd))
            me = LockHolder(self.what, socket.gethostname(), os.getpid(),
                            datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.to_json().encode(), 0)
            self._fd = fd
            return stale
        raise OSError(errno.EAGAIN, f"could not lock {self.path}: it is replaced as fast as it is opened")

    def release(self) -> None:
        """Releases the lock and removes the file (a no-op when not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)  # before unlocking: see the inode check in acquire
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)  # unlocks; the file stays, as after a crash
            except Exception:  # noqa: BLE001 - at interpreter exit ``os`` may be gone
                pass


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode(errors="replace")
    except OSError:
        return ""


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
