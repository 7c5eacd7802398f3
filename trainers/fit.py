"""Whether a valid config fits what it runs on: the batch over the mesh, the data over one batch,
this machine's devices, the output directory.

Each misfit is a :class:`~trainers.errors.ConfigError` naming the keys, their
values and the fix, raised before anything is traced or compiled; a layout
that runs but repeats work (microbatches too small for the batch axes) is a
:class:`~trainers.errors.ConfigWarning` saying the same. What the
config alone decides (the batch over the mesh's batch axes; ``data.max_bytes``
against one batch) is checked when the config is loaded, so ``--print-config``
reports it too; what depends on the machine (its devices, the corpus actually
found, ``train.out_dir`` on disk) is checked by ``--plan`` and at the start of
training.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from multimesh.core.rules import Rules
from trainers.data import count_windows
from trainers.errors import ConfigError, ConfigWarning

__all__ = ["batch_shards", "check_batch", "check_data", "check_devices", "check_memory", "check_microbatch_rows",
           "check_out_dir", "make_out_dir", "mesh_text"]


def mesh_text(mesh: Mapping[str, int]) -> str:
    """``{data: 4, tensor: 2}``: a mesh as it is written in a config or an override."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in mesh.items()) + "}"


def batch_shards(mesh: Mapping[str, int], rule_pairs: Sequence[tuple[str, Any]]) -> tuple[tuple[str, ...], int]:
    """The mesh axes that the rules split the batch dimension (logical ``batch``) over, and how many ways."""
    return logical_shards("batch", mesh, rule_pairs)


def logical_shards(logical: str, mesh: Mapping[str, int],
                   rule_pairs: Sequence[tuple[str, Any]]) -> tuple[tuple[str, ...], int]:
    """The mesh axes that the rules split a dimension of logical name ``logical`` over, and how many ways."""
    spec = Rules(rule_pairs).resolve((logical,), mesh)  # no shape: the axes wanted, none dropped
    entry = spec[0] if len(spec) else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return axes, math.prod(mesh[a] for a in axes)


def check_batch(mesh: Mapping[str, int], rule_pairs: Sequence[tuple[str, Any]], batch_size: int) -> None:
    """``data.batch_size`` must split evenly over the batch axes (the step refuses a batch that does not)."""
    axes, ways = batch_shards(mesh, rule_pairs)
    if batch_size % ways:
        up = -(-batch_size // ways) * ways
        raise ConfigError(
            f"layout.mesh={mesh_text(mesh)} splits the batch over mesh axes {axes} ({ways} ways), but "
            f"data.batch_size={batch_size} is not a multiple of {ways}; set data.batch_size to a multiple of "
            f"{ways} (e.g. data.batch_size={up}), or give layout.mesh batch axes whose sizes multiply to a "
            f"divisor of {batch_size}"
        )


def check_microbatch_rows(mesh: Mapping[str, int], rule_pairs: Sequence[tuple[str, Any]], batch_size: int,
                          microbatches: int, stages: int = 1) -> None:
    """A `ConfigWarning` where a microbatch's rows do not split over the batch axes of the stage mesh: the
    rules then leave its batch dimension whole, so every device of those axes computes the same rows. It runs
    (the result is the same), but those axes' share of the stage's work is repeated, not split."""
    axes, ways = batch_shards(mesh, rule_pairs)
    rows = batch_size // microbatches
    if ways == 1 or rows % ways == 0:
        return
    fewer = max((m for m in range(stages, microbatches, stages)
                 if batch_size % m == 0 and (batch_size // m) % ways == 0), default=None)
    bigger = microbatches * ways * -(-rows // ways)
    instead = f"at most {fewer} microbatches, or " if fewer is not None else ""
    warnings.warn(ConfigWarning(
        f"layout.pipeline.microbatches={microbatches} makes microbatches of {rows} row{'s' * (rows > 1)} "
        f"(data.batch_size={batch_size} / {microbatches}), which the batch axes {' x '.join(axes)} of "
        f"layout.mesh={mesh_text(mesh)} ({ways} ways) do not split: each microbatch's batch dimension stays whole, "
        f"and the {ways} devices along those axes compute the same rows. Use {instead}"
        f"data.batch_size={bigger}"), stacklevel=2)


def check_data(data: Any, ways: int, n_tokens: int | None = None) -> None:
    """The corpus must hold one training batch and one validation batch of at least ``ways`` windows.

    ``data``: the ``data`` section. ``n_tokens``: the corpus found (default: ``data.max_bytes``, the most
    it can be, which the config alone decides).
    """
    found = n_tokens is not None and n_tokens < data.max_bytes
    n = data.max_bytes if n_tokens is None else n_tokens
    n_val = max(1, round(n * data.val_fraction))
    train_windows = count_windows(n - n_val, data.seq_len)
    val_windows = count_windows(n_val, data.seq_len, shuffle=False)
    source = (f"the corpus ({n:,} bytes: all that data.paths holds, below data.max_bytes={data.max_bytes})"
              if found else f"data.max_bytes={data.max_bytes}")
    more = "add text to data.paths" if found else "raise data.max_bytes"
    window = data.seq_len + 1
    if val_windows < ways:
        need = math.ceil((ways * data.seq_len + 1) / data.val_fraction)
        split = " (one per way that layout.mesh splits the batch)" if ways > 1 else ""
        raise ConfigError(
            f"{source} with data.val_fraction={data.val_fraction} leaves a validation split of {n_val} bytes: "
            f"{val_windows} window(s) of {window} (data.seq_len={data.seq_len} + 1), but one validation batch "
            f"needs {ways}{split}; {more} to at least {need:,} bytes, "
            f"or raise data.val_fraction, or lower data.seq_len"
        )
    if train_windows < data.batch_size:
        need = math.ceil((data.batch_size + 1) * data.seq_len / (1 - data.val_fraction)) + 1
        raise ConfigError(
            f"{source} leaves a training split of {n - n_val} bytes: {train_windows} window(s) of {window} "
            f"(data.seq_len={data.seq_len} + 1), fewer than one batch of data.batch_size={data.batch_size}; "
            f"{more} to at least {need:,} bytes, or lower data.batch_size or data.seq_len"
        )


def check_devices(mesh: Mapping[str, int], stages: int | None, available: int, processes: int = 1,
                  more_devices: str = "on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={need}") -> None:
    """The layout (``layout.mesh``, times ``layout.pipeline.stages``) must fit the ``available`` devices, and
    with several processes use all of them. ``more_devices``: how to get ``{need}`` devices, for the error."""
    per_stage = math.prod(mesh.values())
    need = per_stage * (stages or 1)
    shape = f"layout.mesh={mesh_text(mesh)}" + (f" x layout.pipeline.stages={stages}" if stages else "")
    if need > available:
        most = available // (stages or 1)
        if most < 1:  # fewer devices than stages: no layout.mesh helps, only fewer stages or more devices
            fix = (f"give at most layout.pipeline.stages={available} (one device per stage; a pipeline needs "
                   f"2 stages at least)" if available >= 2 else
                   "drop the pipeline (layout.pipeline=null, e.g. the tiny config) to train on one device")
            raise ConfigError(
                f"{shape} needs {need} devices, but this run has {available}: fewer than the {stages} pipeline "
                f"stages; {fix}, or run on more devices ({more_devices.format(need=need)})"
            )
        per = " per pipeline stage" if stages else ""
        raise ConfigError(
            f"{shape} needs {need} devices, but this run has {available}; give layout.mesh sizes whose product "
            f"is at most {most}{per}, e.g. layout.mesh='{{data: {most}}}', or run on more devices "
            f"({more_devices.format(need=need)})"
        )
    if processes > 1 and need != available:
        raise ConfigError(
            f"{shape} uses {need} of the {available} devices, but with {processes} processes a layout must use "
            f"every process's devices: give layout.mesh sizes whose product is {available // (stages or 1)}"
        )


def check_out_dir(path: str | os.PathLike) -> None:
    """``train.out_dir`` must be a directory, or not exist yet under directories."""
    path = Path(path)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = "is an existing file" if part == path else f"lies under {part}, an existing file"
                raise ConfigError(f"train.out_dir={str(path)!r} {what}, not a directory; give a train.out_dir "
                                  f"that is a directory or does not exist yet")
            return


def make_out_dir(path: str | os.PathLike) -> Path:
    """Create ``train.out_dir`` (and its parents); a file in the way, or no permission, is a ConfigError."""
    check_out_dir(path)
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"train.out_dir={str(path)!r} cannot be created: {e.strerror or e}; give a train.out_dir "
                          f"where you may write") from None
    return path


def check_memory(abstract_state: Any, n_params: int, device_count: int) -> None:
    """A `ConfigError` when the train state (parameters and optimizer state, from its shapes and
    shardings: nothing compiled) alone is larger than the memory it would live in, saying by how much
    and what would hold it (`multimesh.estimate.memory`; ``MULTIMESH_MEMORY_LIMIT`` sets the limit)."""
    from multimesh.estimate.memory import StateDoesNotFitError, check_state_fits

    try:
        check_state_fits(abstract_state, what=f"the train state ({n_params / 1e6:,.1f}M parameters and their "
                                              f"optimizer state)")
    except StateDoesNotFitError as e:
        k, smaller = e.at_least, "or a smaller model (model.d_model, model.num_layers)"
        if e.limit.per_device and k <= device_count:
            fix = (f"shard it over more of this run's {device_count} devices, e.g. the fsdp config's rules with "
                   f"layout.mesh={{data: {device_count}}} (each device then holds about "
                   f"{e.total / device_count / 2**30:.1f} GiB of it), {smaller}")
        elif e.limit.per_device:
            fix = (f"it needs at least {k} such devices with the state sharded over all of them (the fsdp config's "
                   f"rules with layout.mesh={{data: {k}}}), {smaller}")
        elif e.total <= e.have:
            fix = (f"shard it over the host's devices instead of copying it to each: the fsdp config's rules with "
                   f"layout.mesh={{data: {device_count}}} keep one copy, {e.total / 2**30:.2f} GiB, on this host")
        else:
            fix = (f"no layout on this host holds it, as its devices share the host's memory: it needs at least {k} "
                   f"such hosts with the state sharded over all their devices (--num-processes {k}, the fsdp "
                   f"config's rules), more memory, {smaller}")
        raise ConfigError(f"{e}; {fix}") from None
    except ValueError as e:  # MULTIMESH_MEMORY_LIMIT that is not a size
        raise ConfigError(str(e)) from None

