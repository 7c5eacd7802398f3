"""The errors the checkpoint module raises (one place, so callers can catch them)."""

from __future__ import annotations

from collections.abc import Sequence


class CheckpointExistsError(FileExistsError):
    """Saving a step that already has a complete checkpoint."""

    def __init__(self, step: int, directory: str):
        self.step = step
        self.directory = directory
        super().__init__(
            f"checkpoint step {step} already exists in {directory}; checkpoints are "
            f"never overwritten. Save under another step number, or delete the old "
            f"one first with manager.delete({step})."
        )


class CheckpointCorruptError(RuntimeError):
    """A checkpoint that is complete on disk but cannot be read back faithfully.

    Raised for unreadable or truncated files (what TensorStore/Orbax report) and
    for data whose checksum differs from the one recorded at save time.

    Attributes:
        step: the checkpoint step.
        path: the step directory (or the damaged file, when it is known).
        leaves: the tree paths found damaged (empty when not known).
    """

    def __init__(self, step: int, path: str, detail: str, leaves: Sequence[str] = ()):
        self.step = step
        self.path = path
        self.leaves = tuple(leaves)
        super().__init__(
            f"checkpoint step {step} is corrupt or unreadable ({path}): {detail}. "
            f"Restore another step, or delete this one."
        )


class CheckpointMismatchError(ValueError):
    """The restore target's tree differs from the saved tree.

    Attributes:
        missing: paths saved in the checkpoint but absent from the target.
        unexpected: paths in the target that the checkpoint does not have
            (each with the nearest saved paths).
        mismatched: ``(path, what, saved, target)`` for shape/dtype differences.
    """

    def __init__(
        self,
        step: int,
        directory: str,
        missing: Sequence[str],
        unexpected: Sequence[str],
        mismatched: Sequence[tuple[str, str, str, str]],
    ):
        self.step = step
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.mismatched = tuple(mismatched)
        counts = [f"{len(v)} {what}" for v, what in ((self.missing, "saved leaf(s) missing from the target"),
                                                       (self.unexpected, "target leaf(s) not in the checkpoint"),
                                                       (self.mismatched, "leaf(s) of another shape, dtype or "
                                                                         "sharding")) if v]
        lines = [f"restore target does not match checkpoint step {step} in {directory}: {', '.join(counts)}."]
        if self.missing or self.unexpected:
            under = _common_top({_path_of(x) for x in (*self.missing, *self.unexpected)})
            where = (f"All of them lie under {under!r}: the state that saved it had another {under!r} (another "
                     f"optimizer or model setting?); restore with that setting, or restore " if under else
                     "To restore ")
            lines.append(f"{where}only part of the saved state (the parameters without the optimizer state...): "
                         f"pass partial=True with a target holding just those leaves, or path='params' with a "
                         f"target for that subtree.")
        shown = [*(f"  missing from target (saved in checkpoint): {p}" for p in self.missing),
                 *(f"  unexpected in target (not in checkpoint): {p}" for p in self.unexpected),
                 *(f"  {what} mismatch at {p}: saved {saved}, target {target}"
                   for p, what, saved, target in self.mismatched)]
        lines += shown[:_SHOWN]
        if len(shown) > _SHOWN:
            lines.append(f"  ... and {len(shown) - _SHOWN} more (all in the error's missing, unexpected and "
                         f"mismatched)")
        super().__init__("\n".join(lines))


#: differences a CheckpointMismatchError lists one per line; it counts the rest
_SHOWN = 12


def _path_of(entry: str) -> str:
    """The leaf path an entry of a difference list starts with (``"opt/0/mu/w [4, 4] float32 ..."``)."""
    return entry.split(" ", 1)[0]


def _common_top(paths: set[str]) -> str | None:
    """The first key every path starts with (``opt`` for ``opt/0/mu/w`` and ``opt/1/count``), None if none."""
    tops = {p.split("/", 1)[0] for p in paths}
    return tops.pop() if len(tops) == 1 and len(paths) > 1 else None


class CheckpointSaveError(OSError):
    """A save that could not write its step (the checkpoint path is a regular
    file, a read-only directory, a full disk, another writer...). Nothing of
    the step is kept; no earlier step is touched.

    Attributes:
        step: the checkpoint step.
        directory: the checkpoint directory.
        reason: what went wrong (the first line's end), e.g. "No space left on device".
    """

    def __init__(self, step: int | None, directory: str, cause: BaseException | str, fix: str | None = None):
        self.step = step
        self.directory = directory
        self.reason = str(cause).rstrip(". ")
        what = f"checkpoint step {step}" if step is not None else "a checkpoint"
        if fix is None:
            fix = (f"Nothing of it was kept; check that {directory} is a writable directory "
                   f"(not a file) with free space.")
        super().__init__(f"could not save {what} in {directory}: {self.reason}. {fix}")
