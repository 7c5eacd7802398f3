"""What a failed save's exception means, in one line: ``CheckpointSaveError``.

Why: Orbax reports a write failure in two shapes. Files written from Python
(step metadata, our JSON document) raise ``OSError``; array data written by
TensorStore raises ``ValueError("RESOURCE_EXHAUSTED: Error writing ... [OS
error 28: No space left on device] ...")`` with a page of TensorStore spec.
Both mean the same to the caller: the step could not be written, for this
reason, at this file. With several processes, a save also exchanges data
between them (checksums, Orbax's barriers): when a peer has stopped, that fails
as "UNKNOWN: Gloo AllGather failed: ... Connection reset by peer": that is
a ``ProcessLostError`` naming the process that stopped.
"""

from __future__ import annotations

import errno
import re

from ..core.processes import ProcessLostError, exception_chain, lost_process_error
from .errors import CheckpointSaveError

_NO_SPACE = "No space left on device"
# a TensorStore status ("RESOURCE_EXHAUSTED: ...", "PERMISSION_DENIED: ...")
_STATUS_RE = re.compile(r"^[A-Z_]{4,}: ")
_FILE_RES = (re.compile(r'Failed writing: "([^"]+)"'), re.compile(r'local file "([^"]+)"'))


def _file(chain: list[BaseException]) -> str | None:
    for x in chain:
        if isinstance(x, OSError) and x.filename:
            return str(x.filename)
    text = " | ".join(str(x) for x in chain)
    for pattern in _FILE_RES:
        if found := pattern.findall(text):
            return found[-1]
    return None


def is_no_space(e: BaseException) -> bool:
    """Whether ``e`` (or what it wraps) is a full disk (ENOSPC, or TensorStore's report of it)."""
    return any((isinstance(x, OSError) and x.errno == errno.ENOSPC)
               or _NO_SPACE in str(x) or "os_error_code='28'" in str(x) for x in exception_chain(e))


def as_save_error(e: BaseException, step: int | None, directory: str
                  ) -> CheckpointSaveError | ProcessLostError | None:
    """``CheckpointSaveError`` for a storage failure of a save, ``ProcessLostError``
    naming the processes that stopped when an exchange between processes failed
    for that; ``None`` when ``e`` is neither (a bug, an interrupt: re-raise it as it is)."""
    if isinstance(e, CheckpointSaveError):
        return e
    chain = exception_chain(e)
    file = _file(chain)
    where = f" (writing {file})" if file else ""
    if is_no_space(e):
        return CheckpointSaveError(
            step, directory, f"{_NO_SPACE}{where}",
            fix=f"Nothing of the step was kept and earlier steps are intact; free space on the disk "
                f"of {directory} (or keep fewer steps with max_to_keep, or save elsewhere), then save again.")
    oserror = next((x for x in chain if isinstance(x, OSError)), None)
    if oserror is not None:
        return CheckpointSaveError(step, directory, oserror)
    # the checksums' gather and Orbax's barriers are exchanges between processes: did a peer stop?
    lost = lost_process_error(e, f"saving checkpoint step {step} in {directory}")
    if isinstance(lost, ProcessLostError):
        return ProcessLostError(f"{lost}. Nothing of step {step} was kept and earlier steps are intact: restart "
                                "the run once every process is up, and it resumes from the newest complete step.")
    status = next((x for x in reversed(chain) if _STATUS_RE.match(str(x))), None)
    if status is not None:
        detail = str(status).split(" [tensorstore_spec")[0].strip().splitlines()[0][:400]
        return CheckpointSaveError(step, directory, detail)
    return None
