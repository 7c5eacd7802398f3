"""Timing a search's best-predicted layouts on the devices themselves: a measured choice among near ties.

A prediction is a model, and where layouts are predicted close to each other
(on a host whose devices share cores, within about 10%: benchmarks/RESULTS.md)
the model cannot tell them apart. `time_layout` builds one layout with the
real initializers and times its step; `auto_layout(..., time_top=k)` does so
for its ``k`` best-predicted layouts, one after another (each freed before the
next is built, so that no two hold device memory at once), and ranks those by
their measured step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..estimate import HardwareProfile

__all__ = ["TimingError", "check_timing", "time_layout"]


class TimingError(ValueError):
    """``time_top=``/``time_steps=`` that cannot be honoured: not a count, or devices not of the profile's kind."""


def check_timing(time_top: int, time_steps: int, profile: HardwareProfile, devices: Sequence[Any]) -> None:
    """A clear error for ``time_top=``/``time_steps=`` that cannot be honoured on these devices."""
    for name, value, least in (("time_top", time_top, 0), ("time_steps", time_steps, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise TimingError(f"auto_layout: {name}={value!r}; give an int >= {least}")
    platform = devices[0].platform if devices else ""
    if time_top and profile.platform and profile.platform != platform:
        raise TimingError(f"auto_layout: time_top={time_top} times layouts on these {platform} devices, but the "
                         f"profile {profile.name!r} is for {profile.platform} devices: their steps would say nothing "
                         f"about it. Leave time_top=0 to plan for devices you do not have, or time on the "
                         f"profile's own devices")


def time_layout(build: Callable[[], Any], steps: int) -> float:
    """The median seconds of one step of ``build()`` (`parallelize`'s ``(step_fn, init_fn, batch_fn)``, built
    without donation) over ``steps`` calls on the same state and batch, after one call that compiles and
    warms it. With several processes every one takes process 0's time, so that all choose alike."""
    step_fn, init_fn, batch_fn = build()
    state, batch = init_fn(), batch_fn()
    jax.block_until_ready(step_fn(state, batch))
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step_fn(state, batch))
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        median = float(multihost_utils.broadcast_one_to_all(np.float64(median)))
    return median
