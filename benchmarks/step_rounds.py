"""Steady-state step time of a training program: the median over rounds of steps, each round ended by a wait.

Shared by the GPU benchmarks (`gpu_run.py`, `gpu_estimate.py`); `benchmarks/` is not a package, so each script
imports this module from its own directory.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["timed_rounds"]


def timed_rounds(step: Any, state: Any, batch: Any, *, rounds: int, steps: int) -> tuple[float, list[float], Any, Any]:
    """Run ``rounds`` rounds of ``steps`` calls of ``step(state, batch) -> (metrics, state)``, waiting for the
    results at the end of each round. Returns the median seconds per step, each round's, the last metrics and
    the last state."""
    import jax

    per_round, metrics = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            metrics, state = step(state, batch)
        jax.block_until_ready((metrics, state))
        per_round.append((time.perf_counter() - start) / steps)
    return statistics.median(per_round), per_round, metrics, state
