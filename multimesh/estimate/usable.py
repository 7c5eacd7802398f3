"""The memory per device the runtime will really give a step: what a fit test compares a peak with.

A datasheet profile's ``memory_bytes`` is the whole device. JAX's allocator on
a GPU takes a share of it: by default it reserves 75% of the device's memory
(``XLA_PYTHON_CLIENT_MEM_FRACTION`` changes the share; JAX's "GPU memory
allocation" page), so a step whose peak lies between 75% and 100% of an H100's
80 GB does not fit as JAX runs it by default. In order:

1. ``MULTIMESH_MEMORY_LIMIT`` (bytes per device, or with a unit: ``60GiB``;
   the variable `memory` reads for the state check before a run): the limit,
   whatever the device;
2. a profile measured by `calibrate`: its ``memory_bytes`` is the allocator's
   own limit already (``memory_stats()["bytes_limit"]``);
3. a GPU profile: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of its memory, 0.75
   where that is not set;
4. any other profile (TPU: the runtime hands the step nearly all of its HBM):
   its ``memory_bytes``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .memory import LIMIT_VARIABLE, parse_bytes
from .profiles import HardwareProfile

__all__ = ["DEFAULT_GPU_MEM_FRACTION", "LIMIT_VARIABLE", "UsableMemory", "usable_memory"]

#: JAX's default share of a GPU's memory that its allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION unset).
DEFAULT_GPU_MEM_FRACTION = 0.75
FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"


@dataclass(frozen=True)
class UsableMemory:
    """``bytes`` per device a step may use, and ``why`` (where the figure comes from)."""

    bytes: int
    why: str


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise ValueError(f"{FRACTION_VARIABLE}={text!r}: JAX takes a fraction in (0, 1] of the GPU's memory")
    return value


def usable_memory(profile: HardwareProfile, environ: Mapping[str, str] | None = None) -> UsableMemory:
    """The memory per device a step may use on ``profile``'s devices (module docstring), from ``environ``
    (default: this process's environment)."""
    env = os.environ if environ is None else environ
    if env.get(LIMIT_VARIABLE):
        return UsableMemory(parse_bytes(env[LIMIT_VARIABLE]), f"{LIMIT_VARIABLE}={env[LIMIT_VARIABLE]}")
    from .calibrate import CalibratedProfile  # a subclass of HardwareProfile: imported here, where it is needed

    if isinstance(profile, CalibratedProfile):
        return UsableMemory(int(profile.memory_bytes), "the allocator's limit, measured by calibrate()")
    if profile.platform == "gpu":
        given = env.get(FRACTION_VARIABLE)
        share = _fraction(given) if given else DEFAULT_GPU_MEM_FRACTION
        why = (f"{FRACTION_VARIABLE}={given} of {profile.name}'s memory" if given else
               f"JAX's default {share:.0%} of {profile.name}'s memory, {FRACTION_VARIABLE} unset")
        return UsableMemory(int(profile.memory_bytes * share), why)
    return UsableMemory(int(profile.memory_bytes), f"{profile.name}'s device memory")
