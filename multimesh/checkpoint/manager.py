"""``CheckpointManager``: sharded, asynchronous, atomic checkpoints over Orbax 0.12.

Each step is one Orbax composite checkpoint with two items:

* ``state``: the pytree of ``jax.Array`` (``ocp.args.StandardSave``); every
  process writes only its own shards, and leaves may live on different meshes
  (MPMD stages on disjoint devices);
* ``multimesh``: a JSON document (``ocp.args.JsonSave``) with the caller's
  metadata and data position and our manifest of the saved tree (path, shape,
  dtype, sharding, checksum of every leaf).

Restoring always takes an explicit target describing the *new* layout; the
manifest lets us check the target before reading any array and verify the
values after.

The files are Orbax's; the handlers that write and read them (``handlers.py``)
differ from Orbax's defaults in three ways: array chunks are not compressed
unless asked (zstd saves ~8% on float data and halves restore speed on a small
host), arrays are read by a leaner path, and the checksums are computed while
the arrays are written or read (``checksum.py``), not in a pass of their own.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import logging
import operator
import os
import re
import uuid
import warnings
from typing import Any, Self

import jax
import orbax.checkpoint as ocp

from ..core.processes import exception_chain
from . import checksum as _checksum
from . import ondisk, quiet, release
from .dirlock import DirectoryInUseError, DirectoryLock
from .errors import CheckpointCorruptError, CheckpointExistsError, CheckpointSaveError
from .finite import warn_if_nonfinite
from .handlers import DocHandler, PendingDoc, StateHandler, SubsetRestore, registry
from .jsonsafe import to_json_safe
from .leaf_names import leaf_names
from .nnx_objects import as_states
from .save_failure import as_save_error
from .tree import (
    LeafRecord,
    MeshRecord,
    PyTree,
    build_manifest,
    check_saveable,
    compare,
    leaves_with_paths,
    normalize_target,
)

#: Orbax item names inside a step directory.
STATE_ITEM = "state"
META_ITEM = "multimesh"
#: Version tag of our JSON document.
FORMAT = "multimesh-checkpoint/2"
#: The writer lock's file in a checkpoint directory (see ``dirlock``).
WRITER_LOCK = ".multimesh-writer.lock"
#: Document versions this module reads, with the checksum format each implies
#: (format 2 names its own in the document's ``checksum`` field).
_READABLE = {"multimesh-checkpoint/1": _checksum.ALGORITHM_V1, FORMAT: None}

_log = logging.getLogger(__name__)
#: how long a failed save waits for Orbax's other item writers before removing its directory
_WRITERS_TIMEOUT_S = 60.0
#: how long a check (`poll`) waits for the other parts of a save of which one failed to end, so that the step
#: is removed before the error is raised; parts still writing then are waited for at the next call
_STRAGGLERS_S = 2.0

if not ocp.__version__.startswith("0.12."):  # pragma: no cover - depends on the install
    warnings.warn(
        f"multimesh.checkpoint is written against orbax-checkpoint 0.12.x; found "
        f"{ocp.__version__}", stacklevel=2)


@dataclasses.dataclass(frozen=True)
class Restored:
    """What ``CheckpointManager.restore`` returns.

    Attributes:
        state: the pytree, placed on the target's shardings.
        metadata: the ``metadata`` given to ``save`` (after a JSON round trip).
        data_position: the ``data_position`` given to ``save`` (JSON round trip).
        step: the step restored.
    """

    state: PyTree
    metadata: Any
    data_position: Any
    step: int


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """Everything recorded about a step, read without loading any array.

    Attributes:
        step, path: the step and its directory.
        metadata, data_position: as given to ``save``.
        leaves: the saved tree, one ``LeafRecord`` per leaf (path, shape, dtype,
            sharding at save time, checksum).
        meshes: the meshes the ``leaves``' named shardings refer to.
        saved_at: ISO time of the save call (UTC).
        versions: library versions of the writer.
        process_count: number of JAX processes of the writer.
        checksum_algorithm: how the leaves' checksums were computed
            (``checksum.ALGORITHM``, or ``checksum.ALGORITHM_V1`` for
            checkpoints of document format 1); ``None`` without checksums.
        format: the version tag of the step's document.
    """

    step: int
    path: str
    metadata: Any
    data_position: Any
    leaves: tuple[LeafRecord, ...]
    meshes: tuple[MeshRecord, ...]
    saved_at: str
    versions: dict
    process_count: int
    checksum_algorithm: str | None = None
    format: str = FORMAT


class CheckpointManager:
    """Saves and restores sharded training state in ``directory/<step>/``.

    Args:
        directory: where checkpoints live; relative paths are made absolute
            (Orbax needs absolute ones). Created unless ``read_only``.
        max_to_keep: keep the newest N complete checkpoints (``None``: all).
        async_save: write in the background (``save`` returns once the arrays
            are copied to host memory); ``wait_until_finished`` blocks.
        checksums: record a checksum of every leaf on save and verify it on
            restore (Orbax itself does not detect flipped bytes in array
            data). The hashing overlaps the I/O: shards are hashed by host
            threads while others are written or read, or on their
            accelerator; see ``checksum.py``.
        compression: zstd-compress array chunks, as Orbax does by default.
            Off by default: it saves ~8% of the bytes of float data and costs
            CPU on every save and restore (restores ran at half the speed on
            a 2-core host, see ``benchmarks/RESULTS.md``). Checkpoints of
            either kind restore either way.
        read_only: never create, write or delete anything (for inspection).

    Raises:
        NotADirectoryError: ``directory`` is an existing file.
        ValueError: ``max_to_keep`` is not a positive int or ``None``.

    Use as a context manager, or call ``close()``, so that a background save
    is finished before the program exits.

    One writer per directory: the first ``save`` (or ``delete``) takes the
    directory's writer lock (a file naming host and pid, released by
    ``close`` or when the process ends); a second manager that saves to the
    same directory meanwhile, in this process or another, gets a
    ``CheckpointSaveError`` naming the holder. With several processes,
    process 0 holds it for the job. A save is reported successful (by
    ``wait_until_finished``, ``close``, ``poll`` or a synchronous ``save``)
    only once its step is committed on disk with this manager's own
    document; a step that another writer committed in its place is a
    ``CheckpointSaveError``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        checksums: bool = True,
        compression: bool = False,
        read_only: bool = False,
    ):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool)):
            raise TypeError(f"max_to_keep must be a positive int (how many steps to keep) or None (keep all), "
                            f"got {max_to_keep!r} ({type(max_to_keep).__name__})")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
        directory = os.fspath(directory)
        if "://" not in directory:
            directory = os.path.abspath(os.path.expanduser(directory))
            if os.path.exists(directory) and not os.path.isdir(directory):
                raise NotADirectoryError(
                    f"checkpoint directory {directory} is a file, not a directory: give the path of a "
                    f"directory (it is created if missing)")
        self._directory = directory
        self._max_to_keep = max_to_keep
        self._async = bool(async_save)
        self._checksums = bool(checksums)
        self._compression = bool(compression)
        self._read_only = bool(read_only)
        self._pending: int | None = None  # the step saved whose commit is not yet confirmed
        self._pending_id: str | None = None  # its document's save_id
        #: a save reported failed while parts of it still wrote: (step, error), ended by `_end_failed`
        self._failed: tuple[int, BaseException] | None = None
        self._save_threads: set = set()  # Orbax's threads of the last save
        self._save_parts: set = set()  # the threads of its parts (the step directory, each item), ended ones too
        self._closed = False
        # read-only: the options Orbax would otherwise reset, with a warning each
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=self._async,
            create=not read_only,
            read_only=self._read_only,
        )
        quiet.install()  # before Orbax's manager: it warns that a read-only directory is read-only
        self._writer_lock = DirectoryLock(
            directory, what="CheckpointManager", name=WRITER_LOCK,
            fix="Each checkpoint directory takes one writer: close the other CheckpointManager "
                "(manager.close()) or stop its process, or save to another directory.")
        self._state_handler = StateHandler(compression=self._compression)
        self._mgr = ocp.CheckpointManager(directory, options=options, handler_registry=registry(
            self._state_handler, DocHandler(), STATE_ITEM, META_ITEM))

    # ----------------------------------------------------------- properties
    @property
    def directory(self) -> str:
        """The absolute checkpoint directory."""
        return self._directory

    def step_path(self, step: int) -> str:
        """The directory of a (complete) step."""
        return os.path.join(self._directory, str(step))

    # ---------------------------------------------------------------- steps
    def all_steps(self) -> list[int]:
        """Complete steps, ascending. A save still in flight is not listed, nor
        is any partial (uncommitted) save left on disk by a crash. Raises the
        ``CheckpointSaveError`` of a background save that failed (see ``poll``)."""
        self._check_open()
        self._settle(block=False)
        steps = set(self._mgr.all_steps())
        steps.discard(self._pending)
        if self._failed is not None:  # a failed save whose other parts still write
            steps.discard(self._failed[0])
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    @property
    def pending_step(self) -> int | None:
        """The step being saved in the background, if any (see ``poll``)."""
        return self.poll()

    def poll(self) -> int | None:
        """Checks on a background save without waiting: returns the step still
        being saved (``None`` when none is), and raises its ``CheckpointSaveError``
        once it has failed (a full disk...) or its step was not committed. A
        part of the save that failed (the document, one item) is raised while
        other parts still write; its step is removed once they end (waited for
        up to 2 s here, else at the next call).

        Cheap (no I/O while the save runs; one small read once it has ended):
        call it every training step, so that a failed save stops the run at
        the next step rather than at the next save.
        """
        self._check_open()
        self._settle(block=False)
        return self._pending

    def reload(self) -> None:
        """Re-reads the list of steps from disk (after changes by another job)."""
        self._check_open()
        self._mgr.reload()

    # ----------------------------------------------------------------- save
    def save(
        self,
        step: int,
        state: PyTree,
        *,
        metadata: Any = None,
        data_position: Any = None,
    ) -> None:
        """Saves ``state`` as checkpoint ``step`` (asynchronously by default).

        Args:
            step: a non-negative int not already saved.
            state: a pytree whose leaves are ``jax.Array`` (sharded on any mesh
                or meshes; typed PRNG keys are fine).
            metadata: any JSON-like description (model config, mesh, rules,
                task layout...); made JSON-safe (see ``to_json_safe``).
            data_position: where the input pipeline is (an int, a dict...),
                made JSON-safe.

        Raises:
            CheckpointExistsError: the step already exists (checkpoints are never
                overwritten).
            CheckpointSaveError: the step could not be written (a full disk
                names "No space left on device"), another writer holds the
                directory or committed this step meanwhile; for a background
                save raised by the next call (``poll``, ``all_steps``,
                ``save``, ``wait_until_finished``, ``close``). Nothing of the
                step is left on disk; earlier steps are untouched.
            ProcessLostError: with several processes, another process stopped
                during the save (it names which); nothing of the step is kept.
            TypeError: a leaf is not a ``jax.Array``.
        """
        self._check_open()
        step = _check_step(step)
        if self._read_only:
            raise PermissionError(f"checkpoint manager for {self._directory} is read-only")
        self._settle(block=True)  # the previous save's error, under its own step
        if step in self._mgr.all_steps():
            raise CheckpointExistsError(step, self._directory)
        state, _ = as_states(state)  # NNX objects as their nnx.State: the key paths Orbax reads back
        named = check_saveable(state)
        names = leaf_names(state)
        if len(names) != len(named):  # pragma: no cover - both flatten the same tree
            raise AssertionError(f"{len(names)} leaf names for {len(named)} leaves")
        leaves, meshes = build_manifest(named, None, names)
        save_id = uuid.uuid4().hex  # tells this save's commit from another writer's
        doc = {
            "format": FORMAT,
            "checksum": _checksum.ALGORITHM if self._checksums else None,
            "step": step,
            "save_id": save_id,
            "saved_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "versions": _versions(),
            "process_count": jax.process_count(),
            "metadata": to_json_safe(metadata, what="metadata"),
            "data_position": to_json_safe(data_position, what="data_position"),
            "tree": {"leaves": [r.to_json() for r in leaves],
                     "meshes": [m.to_json() for m in meshes]},
        }
        json.dumps(doc)  # fail here, not in a background thread
        try:
            self._hold_directory()
        except DirectoryInUseError as e:
            who = e.holder.describe() if e.holder is not None else "another process"
            raise CheckpointSaveError(step, self._directory, f"another writer holds the directory: {who} "
                                      f"(lock file {e.lock_path})", fix=self._writer_lock.fix) from None
        except OSError as e:
            raise CheckpointSaveError(step, self._directory, e) from None
        if "://" not in self._directory and os.path.exists(self.step_path(step)):
            # on disk but not in our list: written since this manager looked
            raise CheckpointSaveError(
                step, self._directory, f"another writer committed step {step} at {self.step_path(step)} "
                "after this manager was opened", fix="Checkpoints are never overwritten; save under "
                "another step, or call reload() to see the steps others wrote.")
        if self._checksums:
            try:  # with several processes, a gather of every process's checksums
                doc = self._with_checksums(doc, [x for _, x in named])
            except Exception as e:
                if (save_error := as_save_error(e, step, self._directory)) is None:
                    raise
                raise save_error from None
        args = ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardSave(state),
            META_ITEM: ocp.args.JsonSave(doc),
        })
        quiet.install()
        before = release.signaling_threads()
        try:
            saved = self._mgr.save(step, args=args, force=True)
        except ocp.checkpoint_manager.StepAlreadyExistsError as e:
            raise CheckpointExistsError(step, self._directory) from e
        except Exception as e:
            self._save_threads = release.signaling_threads() - before
            failure = self._save_failed(step, e)
            if failure is e:
                raise
            raise failure from None
        self._save_threads = release.signaling_threads() - before
        self._save_parts = release.save_parts(self._mgr)
        if not saved:  # pragma: no cover - force=True always saves
            raise RuntimeError(f"Orbax declined to save step {step} in {self._directory}")
        self._pending, self._pending_id = step, save_id
        if not self._async:
            self._settle(block=True)

    def _hold_directory(self) -> None:
        """Takes the directory's writer lock (process 0; once per manager).

        Raises:
            DirectoryInUseError: another writer holds it (names the holder).
            OSError: the lock file cannot be created (not a directory, read-only...).
        """
        if self._writer_lock.held or "://" in self._directory or jax.process_index() != 0:
            return
        try:
            os.makedirs(self._directory, exist_ok=True)
        except OSError:
            pass  # the lock file's creation says what is wrong
        stale = self._writer_lock.acquire()
        if stale is not None and not stale.is_this_process():
            _log.warning("%s: taking over the writer lock of %s, which ended without releasing it",
                         self._directory, stale.describe())

    @staticmethod
    def _with_checksums(doc: dict, arrays: list[jax.Array]) -> dict:
        """The document with the leaves' checksums, or one whose checksums the
        background commit fills in: the hashing starts now (host threads on
        in-place views of CPU shards, kernels on accelerator shards) and runs
        while Orbax writes the arrays."""
        partials = _checksum.start(arrays)

        def fill(d: dict) -> None:
            for rec, value in zip(d["tree"]["leaves"], _checksum.finish(partials)):
                rec["checksum"] = value

        if jax.process_count() > 1:
            # adding up the processes' shares is a collective: do it here, in
            # step on every process, not in a background thread
            fill(doc)
            return doc
        return PendingDoc(doc, fill)

    def wait_until_finished(self) -> None:
        """Blocks until a background save is committed (re-raising its error,
        as ``CheckpointSaveError`` when the files could not be written or the
        step was not committed)."""
        self._check_open()
        self._settle(block=True)

    def _settle(self, block: bool) -> None:
        """Ends the bookkeeping of the pending save once Orbax is done with it (at once when ``block``), or once
        a part of it has failed although others still write (Orbax would report it only once every part before
        it has ended): raises its error, or checks its commit. Parts still writing
        `_STRAGGLERS_S` after a failure are left to end (`_end_failed`, at a later call) before the step is
        removed."""
        if self._failed is not None and (block or not self._saving()):
            self._end_failed()
        step = self._pending
        if step is None:
            return
        # one process: a part that failed is seen at once (several: once Orbax, in step on every process, has
        # ended the save, so that each raises at the same call)
        failed = release.failure(self._save_parts) if jax.process_count() == 1 else None
        if failed is None and not block and self._saving():
            return
        self._pending = None
        if failed is not None:
            release.release(self._save_threads)  # the parts waiting for the failed one's signal end at once
            if not block and release.join(self._save_parts, timeout=_STRAGGLERS_S):
                self._failed = (step, failed)  # raised now; removed once its writers end
                raise as_save_error(failed, step, self._directory) or failed
        try:
            self._mgr.wait_until_finished()
        except Exception as e:
            failed = failed or e
        if failed is not None:
            failure = self._save_failed(step, failed)
            if failure is failed:
                raise failed
            raise failure from None
        self._check_committed(step, self._pending_id)

    def _saving(self) -> bool:
        """Whether the last save still runs: Orbax says so, or one of its writer threads still writes."""
        return self._mgr.is_saving_in_progress() or release.running(self._save_parts)

    def _end_failed(self) -> None:
        """After a save reported failed while parts of it still wrote: waits for them and removes the step
        (its error was raised already)."""
        assert self._failed is not None
        (step, error), self._failed = self._failed, None
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the save's error, raised already
            _log.debug("%s: the failed save of step %s ended: %s", self._directory, step, e)
        self._save_failed(step, error)

    def _check_committed(self, step: int, save_id: str | None) -> None:
        """Raises ``CheckpointSaveError`` unless ``step`` is committed on disk with
        this save's document (process 0, which commits; local paths)."""
        if "://" in self._directory or jax.process_index() != 0:
            return
        path = self.step_path(step)
        committed = ondisk.is_committed(path)
        if committed and _saved_id(path) == save_id:
            return
        if not committed and step not in self._mgr.all_steps():
            return  # committed, then pruned by this manager's own max_to_keep
        self._reload_quietly()
        if committed:
            detail = f"another writer committed step {step} at {path} in place of this save"
        else:
            detail = f"step {step} is not committed at {path}, though the save reported no error"
        raise CheckpointSaveError(step, self._directory, detail, fix=self._writer_lock.fix)

    def _reload_quietly(self) -> None:
        """Re-reads the steps on disk (dropping a failed step Orbax listed already)."""
        try:
            self._mgr.reload()
        except Exception as e:  # noqa: BLE001 - the save's error is the one to report
            _log.debug("reload after a failed save: %s", e)

    def _save_failed(self, step: int | None, e: BaseException) -> BaseException:
        """Cleans up after a failed save and returns the error to raise.

        Orbax's threads that wait for the step directory are released (else
        the process waits ~300 s at exit), those still writing items are
        waited for, the partly written step directory is then removed, and
        the step is dropped from the list of steps. A storage error
        (``OSError``, TensorStore's status) becomes ``CheckpointSaveError``.
        """
        release.release(self._save_threads)
        writing = release.join(self._save_threads, timeout=_WRITERS_TIMEOUT_S)
        self._save_threads, self._save_parts = set(), set()
        if writing:
            _log.warning("%s: %d of Orbax's writer threads of step %s still run %.0f s after the save failed",
                         self._directory, len(writing), step, _WRITERS_TIMEOUT_S)
        if step is not None and "://" not in self._directory and jax.process_index() == 0:
            if not ondisk.remove_partial(self._directory, step):
                _log.warning("%s: could not remove the unfinished save of step %s (restore ignores it)",
                             self._directory, step)
        self._reload_quietly()
        return as_save_error(e, step, self._directory) or e

    def set_aside(self, step: int) -> str:
        """Moves a complete step that cannot be restored (a `CheckpointCorruptError`) out of the list, to
        ``<directory>/corrupt-<step>`` (kept for inspection), so that the step may be saved again; returns
        the new path. With several processes, call it in every process: process 0 moves it."""
        self._check_open()
        if self._read_only:
            raise PermissionError(f"checkpoint manager for {self._directory} is read-only")
        self.wait_until_finished()
        self._resolve(step)
        self._hold_directory()
        aside = os.path.join(self._directory, f"corrupt-{step}")
        n = 1
        while os.path.lexists(aside):
            n += 1
            aside = os.path.join(self._directory, f"corrupt-{step}.{n}")
        if jax.process_index() == 0:
            os.rename(self.step_path(step), aside)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"multimesh checkpoint set aside {step}")
        self._mgr.reload()
        return aside

    def delete(self, step: int) -> None:
        """Deletes a complete checkpoint."""
        self._check_open()
        if self._read_only:
            raise PermissionError(f"checkpoint manager for {self._directory} is read-only")
        self.wait_until_finished()
        self._resolve(step)
        self._hold_directory()  # DirectoryInUseError (a BlockingIOError) names the holder
        self._mgr.delete(step)

    # -------------------------------------------------------------- restore
    def info(self, step: int | None = None) -> CheckpointInfo:
        """What was saved at ``step`` (default: latest), without loading arrays:
        use it to rebuild the model and its target before ``restore``."""
        self._check_open()
        self.wait_until_finished()
        step = self._resolve(step)
        path = self.step_path(step)
        if "://" not in path and not os.path.isdir(path):  # listed when the manager looked, gone since
            gone, what = (path, f"step {step}'s directory") if os.path.isdir(self._directory) else \
                (self._directory, "the checkpoint directory")
            raise FileNotFoundError(
                f"{what} {gone} is gone: it was deleted or moved after this CheckpointManager listed step "
                f"{step}; open a new CheckpointManager on the directory that holds the checkpoints now")
        if not os.path.isdir(os.path.join(path, META_ITEM)) and "://" not in path:
            raise CheckpointCorruptError(
                step, path, f"no '{META_ITEM}' item: the step directory was not "
                "written (completely) by multimesh.checkpoint")
        doc = self._read_item(step, META_ITEM, ocp.args.JsonRestore(), os.path.join(path, META_ITEM))
        if not isinstance(doc, dict) or doc.get("format") not in _READABLE:
            found = doc.get("format") if isinstance(doc, dict) else None
            if isinstance(found, str) and found.startswith("multimesh-checkpoint/"):
                raise CheckpointCorruptError(
                    step, path, f"its '{META_ITEM}' document is in format {found!r}, which this "
                    f"version of multimesh does not read (it reads {sorted(_READABLE)}); "
                    "restore it with the multimesh version that wrote it")
            raise CheckpointCorruptError(step, path, f"unrecognised '{META_ITEM}' document")
        tree = doc.get("tree", {})
        leaves = tuple(LeafRecord.from_json(d) for d in tree.get("leaves", []))
        algorithm = _READABLE[doc["format"]] or doc.get("checksum")
        if not any(r.checksum for r in leaves):
            algorithm = None
        return CheckpointInfo(
            step=step,
            path=path,
            metadata=doc.get("metadata"),
            data_position=doc.get("data_position"),
            leaves=leaves,
            meshes=tuple(MeshRecord.from_json(d) for d in tree.get("meshes", [])),
            saved_at=doc.get("saved_at", ""),
            versions=doc.get("versions", {}),
            process_count=int(doc.get("process_count", 1)),
            checksum_algorithm=algorithm,
            format=doc["format"],
        )

    def restore(self, step: int | None = None, *, target: PyTree, partial: bool = False,
                path: str | None = None) -> Restored:
        """Restores ``step`` (default: the latest complete one) onto ``target``'s layout.

        Args:
            step: the step, or ``None`` for the latest.
            target: the new layout: a pytree with the saved structure whose
                leaves are ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``
                or ``jax.Array`` (only shape/dtype/sharding are used). Any mesh,
                device count or mix of submeshes works. A function built by
                ``parallelize`` stands for its ``abstract_params`` (the state
                laid out by its rules on its mesh or task submeshes), as the
                whole target or as a subtree of it. Required: restoring onto
                the saved layout would break on another device count.
            partial: the target may leave saved leaves out (e.g.
                ``{"params": ...}`` of a saved ``{"params", "opt"}`` state):
                only its leaves are read from disk, each still checked
                against the saved one. The restored state has the target's
                structure.
            path: restore the saved subtree at this path (as ``info()``'s
                leaf ``path``s or ``name``s and the inspector spell them:
                ``"params"``, ``"opt_state/0/mu"``, a boxed leaf's
                ``"params/Dense_0/kernel"``); ``target`` describes that
                subtree (all of it, unless ``partial``) and the restored
                state is it.

        Returns:
            ``Restored(state, metadata, data_position, step)``.

        Raises:
            TypeError: no target, a target leaf without a sharding, or a
                ``path`` that is not a string.
            FileNotFoundError: no such complete step (names the directory and
                the steps that exist).
            CheckpointMismatchError (a ValueError): the target's paths, shapes or
                dtypes differ from the saved ones, or a target sharding does
                not divide a saved shape (lists every difference; a target
                path or ``path`` the checkpoint lacks comes with the nearest
                saved paths).
            CheckpointCorruptError: a file is damaged or a value fails its checksum.

        Warns (``NonFiniteCheckpointWarning``) naming the leaves that hold NaN or
        infinite values, as a checkpoint saved after training diverged does.
        """
        prefix = _subtree_prefix(path)
        target, as_objects = as_states(normalize_target(target))
        if (partial or prefix) and not jax.tree.leaves(target):
            raise ValueError(f"the restore target{f' for path {prefix!r}' if prefix else ''} has no leaves: "
                             "give one jax.ShapeDtypeStruct (with a sharding) per leaf to restore")
        info = self.info(step)
        step, step_dir = info.step, info.path
        wanted = compare(list(info.leaves), target, step=step, directory=self._directory,
                         prefix=prefix, partial=partial)
        verify = self._checksums and info.checksum_algorithm is not None
        if verify and info.checksum_algorithm not in (_checksum.ALGORITHM, _checksum.ALGORITHM_V1):
            raise CheckpointCorruptError(
                step, step_dir, f"its checksums are of an unknown kind ({info.checksum_algorithm!r}); "
                "restore it with the multimesh version that wrote it, or with checksums=False")
        if "://" not in step_dir and not os.path.isdir(os.path.join(step_dir, STATE_ITEM)):
            raise CheckpointCorruptError(
                step, os.path.join(step_dir, STATE_ITEM), f"its '{STATE_ITEM}' item (the arrays) is missing; "
                "the step directory was damaged after it was committed")
        reader = self._state_handler.arrays
        # hash on the read path (while other blocks are still being read)
        hash_on_read = verify and info.checksum_algorithm == _checksum.ALGORITHM
        reader.hasher = _checksum.Hasher() if hash_on_read else None
        reader.hashed = set()
        # Orbax's restore allocates enough small objects to trigger the cyclic
        # GC over and over (~20% of a many-leaves restore); nothing it makes
        # is cyclic garbage worth collecting meanwhile
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            if partial or prefix:  # only the wanted leaves are read
                got = self._read_item(step, STATE_ITEM, SubsetRestore(wanted), os.path.join(step_dir, STATE_ITEM))
            else:
                state = self._read_item(step, STATE_ITEM, ocp.args.StandardRestore(target),
                                        os.path.join(step_dir, STATE_ITEM))
        finally:
            if gc_was_enabled:
                gc.enable()
            hasher, hashed = reader.hasher, reader.hashed
            reader.hasher, reader.hashed = None, set()
        if partial or prefix:
            if lost := [p for p in wanted if p not in got]:
                raise CheckpointCorruptError(
                    step, step_dir, f"its '{STATE_ITEM}' item has no array at {', '.join(lost)}, which "
                    "its manifest lists", leaves=lost)
            named = list(got.items())
            state = jax.tree.unflatten(jax.tree.structure(target), [got[p] for p in wanted])
        else:
            named = leaves_with_paths(state)
        if verify:
            self._verify(info, named, hasher, hashed)
        warn_if_nonfinite(dict(named) if partial or prefix else state, step, step_dir)  # saved paths
        return Restored(as_objects(state), info.metadata, info.data_position, step)

    def _read_item(self, step: int, item: str, args: Any, path: str) -> Any:
        """One item of a step, read by Orbax; storage errors become
        ``CheckpointCorruptError`` with nothing else on stderr.

        The error is raised without Orbax's exception as its context (its
        traceback holds a page of TensorStore spec, and the error's text
        already has TensorStore's status), and what Orbax's failed reads
        leave behind is collected at once, its reports filtered off
        stderr (``quiet``): the Orbax exception must be gone by then, so the
        raise comes after the ``except`` block.
        """
        quiet.install()
        failure = None
        try:
            return self._mgr.restore(step, args=ocp.args.Composite(**{item: args}))[item]
        except Exception as e:
            failure = _as_corrupt(e, step, path)
            if failure is e:
                raise
        gc.collect()
        raise failure

    def _verify(self, info: CheckpointInfo, restored: list[tuple[str, jax.Array]],
                hasher: _checksum.Hasher | None, hashed: set[str]) -> None:
        """Compares the restored leaves' checksums (``restored``: by saved path)
        with the recorded ones: the read path hashed what it read (``hasher``,
        the paths in ``hashed``); the rest (leaves Orbax read) is hashed now."""
        recorded = {r.path: r.checksum for r in info.leaves if r.checksum}
        named = [(p, x) for p, x in restored if p in recorded]
        if not named:
            return
        if info.checksum_algorithm == _checksum.ALGORITHM_V1:
            got = _checksum.checksums_v1([x for _, x in named])
        else:
            rest = [(p, x) for p, x in named if hasher is None or p not in hashed]
            parts = dict(zip([p for p, _ in rest], _checksum.start([x for _, x in rest])))
            got = _checksum.finish([parts[p] if hasher is None or p in parts else hasher.partials(p)
                                    for p, _ in named])
        bad = [p for (p, _), c in zip(named, got) if c != recorded[p]]
        if bad:
            raise CheckpointCorruptError(
                info.step, info.path,
                f"restored values differ from the saved ones (checksum mismatch) at "
                f"{', '.join(bad)}", leaves=bad)

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        partial = ondisk.partial_steps(self._directory) if "://" not in self._directory else []
        note = f"; unfinished saves ignored: {partial}" if partial else ""
        if step is None:
            if not steps:
                raise FileNotFoundError(
                    f"no complete checkpoint in {self._directory} (no steps{note})")
            return steps[-1]
        step = _check_step(step)
        if step not in steps:
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self._directory}; "
                f"complete steps: {steps or 'none'}{note}")
        return step

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Finishes a background save and releases Orbax's resources."""
        if self._closed:
            return
        try:
            self._settle(block=True)
        finally:
            self._closed = True
            self._mgr.close()
            self._writer_lock.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"checkpoint manager for {self._directory} is closed")

    def __repr__(self) -> str:
        if self._closed:
            return f"CheckpointManager({self._directory!r}, closed)"
        pending = self._pending if self._mgr.is_saving_in_progress() else None
        return (
            f"CheckpointManager({self._directory!r}, steps={sorted(set(self._mgr.all_steps()) - {pending})}, "
            f"max_to_keep={self._max_to_keep}, async_save={self._async}"
            + (f", saving={pending}" if pending is not None else "")
            + (", read_only=True" if self._read_only else "") + ")"
        )


# ------------------------------------------------------------------ helpers
def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    step = operator.index(step)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step


def _subtree_prefix(path: Any) -> str:
    """``restore``'s ``path`` as a leaf-path prefix (``""``: the whole tree)."""
    if path is None:
        return ""
    if not isinstance(path, str):
        raise TypeError(f"path must be a str naming a saved subtree as info() spells leaf paths "
                        f"(e.g. 'params' or 'opt_state/0/mu'), got {type(path).__name__}: {path!r}")
    return "" if path.strip("/") == "<root>" else path.strip("/")


def _saved_id(step_path: str) -> str | None:
    """The ``save_id`` in a committed step's document (``None`` if unreadable)."""
    try:
        with open(os.path.join(step_path, META_ITEM, "metadata")) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc.get("save_id") if isinstance(doc, dict) else None


def _versions() -> dict:
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "unknown"

    return {"multimesh": version("multimesh"), "jax": jax.__version__,
            "orbax-checkpoint": ocp.__version__}


# Signs that an exception came from reading damaged files (TensorStore status
# codes, Orbax's read wrapper, JSON or UTF-8 decoding, missing files).
_STORAGE_MARKERS = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "Error reading", "Error decoding",
                    "Encountered error while reading", "Error opening")
_FILE_RE = re.compile(r'local file "([^"]+)"')
_STATUS_RE = re.compile(r"^[A-Z_]+: ")


def _as_corrupt(e: BaseException, step: int, path: str) -> BaseException:
    """``CheckpointCorruptError`` for storage errors; ``e`` itself otherwise."""
    chain = exception_chain(e)

    def is_storage(x: BaseException) -> bool:
        return isinstance(x, (json.JSONDecodeError, UnicodeDecodeError, FileNotFoundError)) or any(
            m in str(x) for m in _STORAGE_MARKERS)

    # TensorStore's own status ("OUT_OF_RANGE: ...") says most; Orbax wraps it.
    status = [x for x in chain if _STATUS_RE.match(str(x))]
    culprit = status[-1] if status else next((x for x in chain if is_storage(x)), None)
    if culprit is None:
        return e
    files = _FILE_RE.findall(" | ".join(str(x) for x in chain))
    lines = str(culprit).split(" [tensorstore_spec")[0].strip().splitlines()
    detail = (lines[0] if lines else type(culprit).__name__)[:400]
    return CheckpointCorruptError(step, files[-1] if files else path, detail)
