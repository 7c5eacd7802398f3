"""What a resumed run keeps from the run it continues, and what it says it changed.

The learning-rate schedule's length (``optimizer.decay_steps``) is fixed by the
run that starts it: ``null`` becomes that run's ``train.steps``, and the
resolved number is written to ``config.yaml`` and to every checkpoint's
metadata. A run resumed with ``decay_steps: null`` takes the number from the
checkpoint, so raising ``train.steps`` continues the schedule (the LR of every
step is that of one uninterrupted run of the same schedule length) rather than
stretching it. Any optimizer setting that does differ from the checkpoint's is
named in one line (``optimizer.lr: 0.003 -> 0.001``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from trainers.config import Config

__all__ = ["continue_schedule", "optimizer_changes", "saved_decay_steps"]


def saved_decay_steps(saved: Mapping[str, Any]) -> int | None:
    """The schedule length of the run that wrote config ``saved`` (a checkpoint's metadata): its
    ``optimizer.decay_steps``, or its ``train.steps`` where that is null or absent (older checkpoints, whose
    schedule ran over ``train.steps``); None if neither is an int."""
    opt, tc = saved.get("optimizer"), saved.get("train")
    value = opt.get("decay_steps") if isinstance(opt, Mapping) else None
    if value is None and isinstance(tc, Mapping):
        value = tc.get("steps")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def continue_schedule(cfg: Config, saved: Mapping[str, Any] | None) -> Config:
    """``cfg`` with ``optimizer.decay_steps`` resolved: as given, else the saved run's (``saved``: the config
    of the checkpoint resumed from), else (a fresh run) ``train.steps``."""
    if cfg.optimizer.decay_steps is not None:
        return cfg
    steps = saved_decay_steps(saved) if saved is not None else None
    return cfg.replace(optimizer={"decay_steps": cfg.train.steps if steps is None else steps})


def optimizer_changes(saved: Mapping[str, Any], cfg: Config) -> list[str]:
    """``optimizer.KEY: old -> new`` for every optimizer setting of ``cfg`` that differs from the saved
    config's (keys the saved config lacks, from an older trainer, are not compared; ``decay_steps`` is)."""
    old = dict(saved.get("optimizer") or {})
    old["decay_steps"] = saved_decay_steps(saved)
    changes = []
    for key, new in dataclasses.asdict(cfg.optimizer).items():
        if key in old and old[key] != new:
            changes.append(f"optimizer.{key}: {old[key]} -> {new}")
    return changes
