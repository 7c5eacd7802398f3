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
        lines = [f"restore target does not match checkpoint step {step} in {directory}:"]
        for p in self.missing:
            lines.append(f"  missing from target (saved in checkpoint): {p}")
        for p in self.unexpected:
            lines.append(f"  unexpected in target (not in checkpoint): {p}")
        for p, what, saved, target in self.mismatched:
            lines.append(f"  {what} mismatch at {p}: saved {saved}, target {target}")
        if self.missing:
            lines.append("To restore only part of the saved state (the parameters without the optimizer "
                         "state...), pass partial=True with a target holding just those leaves, or "
                         "path='params' with a target for that subtree.")
        super().__init__("\n".join(lines))


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
