"""Plan before you run: memory per device, work and predicted step time of a step, from its compiled programs.

    from multimesh.jax import estimate
    est = estimate(step_fn, profile="h100-sxm")   # or step_fn.estimate(...)
    print(est); est.fits(80 * 2**30)

This layer reads the step's layouts, plan and runtime (``core``, ``plan``,
``run``); only the public API and the steps' ``estimate`` method import it.

The package re-exports the function `estimate` under this package's name
(``multimesh.estimate``), so this module is callable as that function:
``multimesh.estimate(step_fn, ...)`` and ``multimesh.estimate.calibrate()``
both work.
"""

import inspect
import sys
import types

from .build import estimate, estimate_mjit
from .calibrate import CalibratedProfile, calibrate
from .collectives import Collective, find_collectives
from .compiler_log import Reshard
from .held import DEFAULT_OPTIMIZER_PATHS, HeldBytes, held_bytes, shard_bytes
from .profiles import PROFILES, HardwareProfile, UnknownProfileError, get_profile
from .programs import ProgramCost
from .report import DeviceMemory, Estimate, MemoryLimitError, StepTime
from .timing import ProgramTime, collective_time
from .utilisation import ImpossibleRateError, model_flops

__all__ = [
    "DEFAULT_OPTIMIZER_PATHS",
    "PROFILES",
    "CalibratedProfile",
    "Collective",
    "DeviceMemory",
    "Estimate",
    "HardwareProfile",
    "HeldBytes",
    "ImpossibleRateError",
    "MemoryLimitError",
    "ProgramCost",
    "ProgramTime",
    "Reshard",
    "StepTime",
    "UnknownProfileError",
    "calibrate",
    "collective_time",
    "estimate",
    "estimate_mjit",
    "find_collectives",
    "get_profile",
    "held_bytes",
    "model_flops",
    "shard_bytes",
]


class _CallableModule(types.ModuleType):
    """This package, callable as `estimate`: the name ``multimesh.estimate`` stands for both."""

    def __call__(self, *args, **kwargs):
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__signature__ = inspect.signature(estimate)
