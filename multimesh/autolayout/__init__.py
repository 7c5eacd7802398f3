"""Automatic layouts: search meshes, rules and pipelines for a step, keep those that fit, rank by step time.

    from multimesh.jax import auto_layout
    search = auto_layout(step, init_params=init, get_input_batch=get_batch, num_devices=8, profile="h100-sxm")
    print(search); search.best          # the table; the fastest layout that fits
    step_fn, init_fn, batch_fn = parallelize(step, ..., layout="auto", profile="h100-sxm")

This layer sits above `multimesh.estimate` (it builds steps with `run` and
estimates them); nothing below imports it. The public `parallelize`
(`multimesh.parallelize`, above this layer) gives ``layout="auto"`` to
`front.parallelize_auto`.
"""

from .building import PipelineFactory, stage_task
from .layouts import RULE_SETS, STAGE_AXIS, ParallelLayout, enumerate_layouts, factorizations
from .search import (
    Candidate,
    LayoutSearch,
    LayoutSearchError,
    NoLayoutFitsError,
    NoValidLayoutError,
    auto_layout,
)
from .timing import TimingError

__all__ = [
    "RULE_SETS",
    "STAGE_AXIS",
    "Candidate",
    "ParallelLayout",
    "LayoutSearch",
    "LayoutSearchError",
    "NoLayoutFitsError",
    "NoValidLayoutError",
    "PipelineFactory",
    "TimingError",
    "auto_layout",
    "enumerate_layouts",
    "factorizations",
    "stage_task",
]
