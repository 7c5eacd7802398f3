"""What the GPU benchmarks (`gpu_run.py`, `gpu_estimate.py`) share: a device's datasheet profile and the
steady-state step time of a training program. `benchmarks/` is not a package: each script imports this module
from its own directory.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["DATASHEET", "datasheet_profile", "timed_rounds"]

#: Datasheet profiles (`multimesh.estimate.get_profile`) by what a device kind contains, the first that matches
#: ("NVIDIA A100-SXM4-40GB" before any other A100).
DATASHEET = {"H200": "h200", "H100": "h100-sxm", "B200": "b200", "A100-SXM4-40GB": "a100-40gb", "A100": "a100-80gb"}


def datasheet_profile(device_kind: str) -> str | None:
    """The datasheet profile of a device of this kind (``jax.Device.device_kind``); None: none matches."""
    return next((name for key, name in DATASHEET.items() if key in device_kind), None)


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
