"""`parallelize_auto`: `parallelize` with ``layout="auto"``: the layout `auto_layout` picks, then built with the
real initializers.

The public `multimesh.parallelize.parallelize` calls it from above, so that the layer that builds steps
(`multimesh.run`) never imports the one that searches layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from ..estimate import HardwareProfile
from ..run.parallelize import ParallelizeResult
from .building import PipelineFactory, build_on
from .model_axes import AxisTypes
from .search import auto_layout

__all__ = ["parallelize_auto"]


def parallelize_auto(fun: Callable, *, profile: str | HardwareProfile | None, num_devices: int | None,
                     memory_limit: int | None, axes: Sequence[str] | None, axis_types: AxisTypes,
                     pipeline: PipelineFactory | None, stage_counts: Sequence[int], microbatches: Sequence[int],
                     schedules: Sequence[str], rule_sets: Sequence[str], progress: bool | None, time_top: int,
                     time_steps: int, dtype: str | None, model_flops: float | None,
                     devices: Sequence[Any] | None, mesh: Any, initial_batch: Any,
                     **on_mesh: Any) -> ParallelizeResult:
    """`parallelize(fun, layout="auto", ...)`: every argument as there; ``on_mesh`` are those the chosen
    layout is built with (``init_params``, ``get_input_batch``, ``rules`` for the model's own names, ...)."""
    if profile is None:
        raise TypeError("parallelize(layout='auto') needs profile= (a name such as 'h100-sxm', or a "
                        "HardwareProfile, e.g. multimesh.estimate.calibrate()) to predict step times with")
    if mesh is not None:
        raise TypeError("parallelize(layout='auto') chooses mesh=; leave it out, or drop layout='auto'")
    if initial_batch is not None:
        raise TypeError("parallelize(layout='auto') needs get_input_batch= (it is evaluated abstractly for every "
                        "layout tried), not initial_batch=")
    search = auto_layout(fun, profile=profile, devices=devices, num_devices=num_devices, memory_limit=memory_limit,
                         axes=axes, axis_types=axis_types, pipeline=pipeline, stage_counts=stage_counts,
                         microbatches=microbatches, schedules=schedules, rule_sets=rule_sets, progress=progress,
                         time_top=time_top, time_steps=time_steps, dtype=dtype, model_flops=model_flops, **on_mesh)
    pool = list(devices) if devices is not None else jax.devices()[:search.num_devices]
    on_mesh.pop("rules", None)
    made = build_on(search.best, fun, pool, pipeline, explicit_axes=search.explicit_axes,
                    own_rules=search.own_rules, **on_mesh)
    made[0].layout_search = search
    return made
