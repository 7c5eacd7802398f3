"""The public `parallelize`: `multimesh.run.parallelize.parallelize_on_mesh`, or with ``layout="auto"`` the
layout `auto_layout` picks.

It lives here, above the search, so that the layer that builds steps
(`multimesh.run`) never imports the one that searches layouts.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Sequence
from typing import Any, overload

import jax

from ..estimate import HardwareProfile
from ..run.initializers import StepAndInit, StepFunctions
from ..run.parallelize import BatchStep, ParallelizeResult, StepOnly, parallelize_on_mesh
from . import building
from .building import PipelineFactory, build_on
from .layouts import RULE_SETS
from .model_axes import AxisTypes
from .search import auto_layout

__all__ = ["parallelize"]

#: Files whose lines a warning of `parallelize` would name instead of the caller's (it warns at its caller).
_WRAPPERS = frozenset({__file__, building.__file__})


def _call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its warnings issued again after it (`_reissue`), even when it raises."""
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:  # the caller's filters apply to what is caught,
            # but those naming these modules: each is judged by them when issued again at the caller's line
            warnings.filterwarnings("always", module=r"multimesh\.autolayout\.(front|building)$")
            return fn(*args, **kwargs)
    finally:
        _reissue(caught)


def _reissue(pending: list) -> None:
    """Each warning again; one that names this wrapper's lines (the run layer warns at its caller, which is
    now this module) names the line that called `parallelize` instead."""
    for w in pending:
        if w.filename in _WRAPPERS:
            warnings.warn(w.message, stacklevel=4)  # _reissue, _call, parallelize, its caller
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


@overload
def parallelize(fun: Callable, *, init_params: Callable[[], Any], get_input_batch: Callable[[], Any],
                **options: Any) -> StepFunctions: ...
@overload
def parallelize(fun: Callable, *, init_params: Callable[[], Any], initial_batch: Any,
                **options: Any) -> StepAndInit: ...
@overload
def parallelize(fun: Callable, *, get_input_batch: Callable[[], Any], **options: Any) -> BatchStep: ...
@overload
def parallelize(fun: Callable, *, initial_batch: Any, **options: Any) -> StepOnly: ...


def parallelize(fun: Callable, *, layout: str | None = None, profile: str | HardwareProfile | None = None,
                num_devices: int | None = None, memory_limit: int | None = None,
                axes: Sequence[str] | None = None, axis_types: AxisTypes = None,
                pipeline: PipelineFactory | None = None,
                stage_counts: Sequence[int] = (1,), microbatches: Sequence[int] = (4, 8),
                schedules: Sequence[str] = ("1f1b", "zb-h2"), rule_sets: Sequence[str] = RULE_SETS,
                progress: bool | None = None, time_top: int = 0, time_steps: int = 3, dtype: str | None = None,
                model_flops: float | None = None, **kwargs: Any) -> ParallelizeResult:
    """Compile ``fun(params, batch, *args)`` into a sharded function.

    Args:
      fun: the one-device step; parameters first, the batch second (without
        ``init_params``: ``fun(batch)``).
      init_params: zero-argument function returning the parameters (or the
        whole train state); evaluated abstractly, then compiled so that each
        parameter is created directly in its sharding. Optional when ``fun``
        takes no parameters: the sharded function is then called as ``fn(batch)``.
      get_input_batch: zero-argument function returning an example batch.
      initial_batch: instead of ``get_input_batch``, a batch (array or pytree).
      devices: the devices to use (default: all).
      mesh: a `Mesh`, or an ``{axis: size}`` shape laid over ``devices``
        (default: the global mesh of the `MultiMesh` in force, else 1-D
        ``{"data": len(devices)}``).
      rules: logical axis rules (see `multimesh.rules`); default: those of Flax's
        ``nn.logical_axis_rules`` / ``axis_rules`` context in force, if any; without rules, only
        annotations that name mesh axes shard anything.
      param_rules: ``{regex: spec}`` for parameters that carry no metadata.
      batch_spec: logical spec of every batch leaf unless ``fun`` constrains it
        (default: the leading dimension is ``"batch"``).
      donate: donate the parameters' buffers to the step (feed its new state back).
      strict: indivisible dimensions and logical names without a rule are errors.
      layout: ``"auto"``: the mesh, rules and pipeline are chosen by `auto_layout` (``profile=``
        required; ``devices=``/``num_devices=``, ``memory_limit=``, ``axes=``, ``axis_types=``,
        ``pipeline=``, ``stage_counts=``, ``microbatches=``, ``schedules=``, ``rule_sets=``,
        ``progress=``, ``time_top=``, ``time_steps=``, ``dtype=``, ``model_flops=`` as there, and
        ``rules=``: rules for the model's own logical names, given before the search's), then built
        like any other layout with the real ``init_params``. The returned step has ``.layout_search``,
        the `LayoutSearch`. Without it (default) the step is built on ``mesh=`` (or the mesh in force)
        and those arguments are refused.

    Returns:
      A `ParallelizeResult`: with ``get_input_batch``, a `StepFunctions` ``(step, init_params,
      get_input_batch)``, else a `StepAndInit` ``(step, init_params)``: named
      tuples, so ``step_fn, init_fn, batch_fn = parallelize(...)`` unpacks
      them. Without ``init_params`` the same less ``init_params``
      (`BatchStep`, or `StepOnly` with ``initial_batch``).
    """
    auto_only = {"profile": profile, "num_devices": num_devices, "memory_limit": memory_limit,
                 "pipeline": pipeline, "time_top": time_top or None, "axes": axes, "axis_types": axis_types,
                 "dtype": dtype, "model_flops": model_flops}
    if layout is None:
        given = [k for k, v in auto_only.items() if v is not None]
        if given:
            raise TypeError(f"parallelize: {', '.join(given)}= only serve layout='auto' (the layout search); "
                            f"pass layout='auto', or leave them out and give mesh= and rules=")
        return _call(parallelize_on_mesh, fun, **kwargs)
    if layout != "auto":
        raise ValueError(f"parallelize: layout={layout!r}; the one layout parallelize chooses is 'auto' (give a "
                         f"mesh of your own as mesh= with rules=)")
    if profile is None:
        near = difflib.get_close_matches("profile", list(kwargs), n=1)
        raise TypeError("parallelize(layout='auto') needs profile= (a name such as 'h100-sxm', or a "
                        "HardwareProfile, e.g. multimesh.estimate.calibrate()) to predict step times with"
                        + (f"; is {near[0]}= a misspelling of profile=?" if near else ""))
    if kwargs.get("mesh") is not None:
        raise TypeError("parallelize(layout='auto') chooses mesh=; leave it out, or drop layout='auto'")
    if "initial_batch" in kwargs:
        raise TypeError("parallelize(layout='auto') needs get_input_batch= (it is evaluated abstractly for every "
                        "layout tried), not initial_batch=")
    devices = kwargs.pop("devices", None)
    search = auto_layout(fun, profile=profile, devices=devices, num_devices=num_devices, memory_limit=memory_limit,
                         axes=axes, axis_types=axis_types, pipeline=pipeline, stage_counts=stage_counts,
                         microbatches=microbatches, schedules=schedules, rule_sets=rule_sets, progress=progress,
                         time_top=time_top, time_steps=time_steps, dtype=dtype, model_flops=model_flops, **kwargs)
    pool = list(devices) if devices is not None else jax.devices()[:search.num_devices]
    kwargs.pop("rules", None)
    made = _call(build_on, search.best, fun, pool, pipeline, explicit_axes=search.explicit_axes,
                 own_rules=search.own_rules, **kwargs)
    made[0].layout_search = search
    return made
