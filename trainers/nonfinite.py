"""Non-finite training: the step's count of bad parameter values, and finding the first step that went bad.

The train step returns its loss, its gradient norm and ``nonfinite_params``,
how many values of the *updated* parameters are NaN or infinite (one fused
reduction on the device). The loop reads them where it already waits for the
step's results (``trainers.train._Loop._sync``), so checking them costs no
extra device sync; and it waits there before every checkpoint, so the state a
checkpoint would hold has always been checked before the save starts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["EXIT_CODE", "NonFiniteError", "NonFiniteWarning", "count_nonfinite", "first_nonfinite", "how_to_fix"]

#: Exit status of ``multimesh-train`` when a run stops on a non-finite value (0 done, 1 a crash, 2 a config error).
EXIT_CODE = 3


class NonFiniteError(RuntimeError):
    """Training produced a NaN or infinity (``train.on_nonfinite=stop``); nothing non-finite was saved.

    ``step``: the first step found bad; ``problem``: what was non-finite;
    ``checkpoint``: the newest committed checkpoint (``None``: none yet).
    """

    def __init__(self, step: int, problem: str, checkpoint: str | None, fix: str):
        self.step, self.problem, self.checkpoint = step, problem, checkpoint
        if checkpoint is None:
            last, again = "no checkpoint had been saved yet", "run again"
        else:
            last, again = f"the last checkpoint, {checkpoint}, was saved before it", "run again to resume from it"
        super().__init__(
            f"non-finite values at step {step} ({problem}); training stopped and nothing non-finite was "
            f"saved: {last}. {fix} and {again}, or set train.on_nonfinite=warn to train on regardless")


class NonFiniteWarning(RuntimeWarning):
    """Training produced a NaN or infinity and goes on (``train.on_nonfinite=warn``)."""


def count_nonfinite(tree: Any) -> jax.Array:
    """How many values of ``tree``'s floating-point leaves are NaN or infinite (a float32 scalar,
    exact up to 2**24, which is all that matters for "is it zero")."""
    total = jnp.float32(0)
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            total = total + jnp.sum(~jnp.isfinite(x), dtype=jnp.float32)
    return total


def how_to_fix(lr: float, clip_norm: float | None) -> str:
    """What to change in the optimizer config of a run that diverged."""
    clip = "" if clip_norm is not None else " or set optimizer.clip_norm (now null)"
    return f"Lower optimizer.lr (now {lr:g}){clip}"


def _problems(metrics: Mapping[str, Any]) -> list[str]:
    found = []
    for key, name in (("loss", "loss"), ("grad_norm", "gradient norm")):
        value = float(metrics[key])
        if not math.isfinite(value):
            found.append(f"{name} {value}")
    bad = float(metrics.get("nonfinite_params", 0.0))
    if bad:
        found.append(f"{bad:.0f} parameter value(s) NaN or infinite after the update")
    return found


def first_nonfinite(steps: Iterable[tuple[int, Mapping[str, Any]]]) -> tuple[int, str] | None:
    """The first ``(step, what was non-finite)`` among ``(step, fetched metrics)`` pairs, or None."""
    for step, metrics in steps:
        found = _problems(metrics)
        if found:
            return step, ", ".join(found)
    return None
