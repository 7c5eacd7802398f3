"""`parallelize`, the front door: a one-device step compiled into a sharded one.

It sits above both roads it takes, so that neither imports the other: the
step built on a mesh given or in force (`multimesh.run.parallelize`), or,
with ``layout="auto"``, the layout the search picks
(`multimesh.autolayout.front`). Public as ``multimesh.jax.parallelize``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypedDict, Unpack, overload

import numpy as np

from .autolayout import building, front
from .autolayout.building import PipelineFactory
from .autolayout.front import parallelize_auto
from .autolayout.layouts import RULE_SETS
from .autolayout.model_axes import AxisTypes
from .core.keyword_hints import keyword_hints
from .core.meshes import MeshLike
from .core.rules import MeshAxes, PathRules, Rules
from .estimate import HardwareProfile
from .run.initializers import StepAndInit, StepFunctions
from .run.parallelize import BatchStep, ParallelizeResult, StepOnly, parallelize_on_mesh

__all__ = ["ParallelizeOptions", "parallelize"]

#: Files whose lines a warning of `parallelize` would name instead of the caller's (it warns at its caller).
_WRAPPERS = frozenset({__file__, front.__file__, building.__file__})


class ParallelizeOptions(TypedDict, total=False):
    """The keyword arguments of `parallelize` other than the function, its initializers and its batch (the
    overloads' ``**options``): each is described there."""

    devices: Sequence[Any] | np.ndarray | None
    mesh: MeshLike
    rules: Iterable[tuple[str, MeshAxes]] | Rules | None
    param_rules: PathRules | dict | Iterable | None
    batch_spec: tuple
    donate: bool
    strict: bool
    layout: str | None
    profile: str | HardwareProfile | None
    num_devices: int | None
    memory_limit: int | None
    axes: Sequence[str] | None
    axis_types: AxisTypes
    pipeline: PipelineFactory | None
    stage_counts: Sequence[int]
    microbatches: Sequence[int]
    schedules: Sequence[str]
    rule_sets: Sequence[str]
    progress: bool | None
    time_top: int
    time_steps: int
    dtype: str | None
    model_flops: float | None


@overload
def parallelize(fun: Callable, *, init_params: Callable[[], Any], get_input_batch: Callable[[], Any],
                **options: Unpack[ParallelizeOptions]) -> StepFunctions: ...
@overload
def parallelize(fun: Callable, *, init_params: Callable[[], Any], initial_batch: Any,
                **options: Unpack[ParallelizeOptions]) -> StepAndInit: ...
@overload
def parallelize(fun: Callable, *, get_input_batch: Callable[[], Any],
                **options: Unpack[ParallelizeOptions]) -> BatchStep: ...
@overload
def parallelize(fun: Callable, *, initial_batch: Any, **options: Unpack[ParallelizeOptions]) -> StepOnly: ...


@keyword_hints
def parallelize(
    fun: Callable,
    *,
    init_params: Callable[[], Any] | None = None,
    get_input_batch: Callable[[], Any] | None = None,
    initial_batch: Any = None,
    devices: Sequence[Any] | np.ndarray | None = None,
    mesh: MeshLike = None,
    rules: Iterable[tuple[str, MeshAxes]] | Rules | None = None,
    param_rules: PathRules | dict | Iterable | None = None,
    batch_spec: tuple = ("batch",),
    donate: bool = False,
    strict: bool = False,
    layout: str | None = None,
    profile: str | HardwareProfile | None = None,
    num_devices: int | None = None,
    memory_limit: int | None = None,
    axes: Sequence[str] | None = None,
    axis_types: AxisTypes = None,
    pipeline: PipelineFactory | None = None,
    stage_counts: Sequence[int] = (1,),
    microbatches: Sequence[int] = (4, 8),
    schedules: Sequence[str] = ("1f1b", "zb-h2"),
    rule_sets: Sequence[str] = RULE_SETS,
    progress: bool | None = None,
    time_top: int = 0,
    time_steps: int = 3,
    dtype: str | None = None,
    model_flops: float | None = None,
) -> ParallelizeResult:
    """Compile ``fun(params, batch, *args)``, written for one device, into a sharded function.

    Parameters and batches are evaluated abstractly (nothing is materialised), every sharding is derived from
    the annotations and ``rules``, and the step is one `jax.jit` on the mesh (SPMD) or, when it calls tasks
    (`task`, `register_task`), an MPMD plan whose stages run on their own submeshes.

    Args:
      fun: the one-device step; parameters first, the batch second (without ``init_params``: ``fun(batch)``).
      init_params: zero-argument function returning the parameters (or the whole train state); evaluated
        abstractly, then compiled so that each parameter is created directly in its sharding. Optional when
        ``fun`` takes no parameters: the sharded function is then called as ``fn(batch)``.
      get_input_batch: zero-argument function returning an example batch.
      initial_batch: instead of ``get_input_batch``, a batch (array or pytree).
      devices: the devices to use (default: all).
      mesh: a `Mesh`, or an ``{axis: size}`` shape laid over ``devices`` (default: the global mesh of the
        `MultiMesh` in force, else 1-D ``{"data": len(devices)}``).
      rules: logical axis rules (see `Rules`), e.g. ``[("batch", "data"), ("mlp", "model")]``; default: those
        of Flax's ``nn.logical_axis_rules`` / ``axis_rules`` context in force, if any; without rules, only
        annotations that name mesh axes shard anything.
      param_rules: ``{regex: spec}`` for parameters that carry no metadata (see `PathRules`).
      batch_spec: logical spec of every batch leaf unless ``fun`` constrains it (default: the leading
        dimension is ``"batch"``).
      donate: donate the parameters' buffers to the step (feed its new state back).
      strict: indivisible dimensions and logical names without a rule are errors, not warnings.
      layout: ``"auto"``: the mesh, rules and pipeline are chosen by `auto_layout` (``profile=`` required),
        then built like any other layout with the real ``init_params``; the returned step has
        ``.layout_search``, the `LayoutSearch`. ``rules=`` then gives rules for the model's own logical
        names, before the search's. Default: the step is built on ``mesh=`` (or the mesh in force) and the
        arguments below are refused.
      profile: with ``layout="auto"``: the hardware to predict step times on, a name (``"h100-sxm"``) or a
        `HardwareProfile` (e.g. ``multimesh.estimate.calibrate()``).
      num_devices: with ``layout="auto"``: instead of ``devices``, the first ``num_devices`` devices.
      memory_limit: with ``layout="auto"``: bytes per device (default: the profile's memory).
      axes: with ``layout="auto"``: the mesh axes whose sizes are searched (default: data, fsdp, tensor and
        those the model names itself).
      axis_types: with ``layout="auto"``: ``"explicit"`` or ``"auto"`` mesh axes (see `auto_layout`).
      pipeline: with ``layout="auto"``: ``pipeline(stages, chunks)`` -> a context manager registering the
        model's stages; needed for ``stage_counts`` above 1.
      stage_counts: with ``layout="auto"``: pipeline stage counts to try (1: SPMD).
      microbatches: with ``layout="auto"``: microbatch counts tried for every pipeline.
      schedules: with ``layout="auto"``: schedules tried for every pipeline.
      rule_sets: with ``layout="auto"``: named rule sets tried on every mesh.
      progress: with ``layout="auto"``: a progress bar (default: when stderr is a terminal).
      time_top: with ``layout="auto"``: time that many best-predicted layouts on the devices and pick the
        fastest measured (0: pick by prediction).
      time_steps: with ``layout="auto"``: steps timed per layout with ``time_top``.
      dtype: with ``layout="auto"``: price every flop at this dtype's peak.
      model_flops: with ``layout="auto"``: one step's model flops, for each candidate's MFU.

    Returns:
      A `ParallelizeResult`: with ``get_input_batch``, a `StepFunctions` ``(step, init_params,
      get_input_batch)``, else a `StepAndInit` ``(step, init_params)``: named tuples, so
      ``step_fn, init_fn, batch_fn = parallelize(...)`` unpacks them. Without ``init_params`` the same less
      ``init_params`` (`BatchStep`, or `StepOnly` with ``initial_batch``).

    Example:
        ```python
        import jax, jax.numpy as jnp
        from multimesh.jax import parallelize

        def init():
            return {"w": jnp.zeros((256, 1024))}

        def get_batch():
            return jnp.ones((64, 256))

        def step(params, x):
            loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
            return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

        step_fn, init_fn, batch_fn = parallelize(
            step, init_params=init, get_input_batch=get_batch,
            mesh={"data": jax.device_count()}, rules=[("batch", "data")], donate=True)
        params = init_fn()                      # born sharded
        loss, params = step_fn(params, batch_fn())
        print(step_fn.report())                 # where every array lives
        ```
    """
    on_mesh: dict[str, Any] = dict(init_params=init_params, get_input_batch=get_input_batch,
                                   initial_batch=initial_batch, devices=devices, mesh=mesh, rules=rules,
                                   param_rules=param_rules, batch_spec=batch_spec, donate=donate, strict=strict)
    search: dict[str, Any] = dict(profile=profile, num_devices=num_devices, memory_limit=memory_limit, axes=axes,
                                  axis_types=axis_types, pipeline=pipeline, stage_counts=stage_counts,
                                  microbatches=microbatches, schedules=schedules, rule_sets=rule_sets,
                                  progress=progress, time_top=time_top, time_steps=time_steps, dtype=dtype,
                                  model_flops=model_flops)
    if layout is None:
        auto_only = ("profile", "num_devices", "memory_limit", "pipeline", "time_top", "axes", "axis_types", "dtype",
                     "model_flops")
        values = {**search, "time_top": time_top or None}  # time_top=0 is its default
        given = [k for k in auto_only if values[k] is not None]
        if given:
            raise TypeError(f"parallelize: {', '.join(given)}= only serve layout='auto' (the layout search); "
                            f"pass layout='auto', or leave them out and give mesh= and rules=")
        return _call(parallelize_on_mesh, fun, **on_mesh)
    if layout != "auto":
        raise ValueError(f"parallelize: layout={layout!r}; the one layout parallelize chooses is 'auto' (give a "
                         f"mesh of your own as mesh= with rules=)")
    return _call(parallelize_auto, fun, **search, **on_mesh)


def _call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its warnings issued again after it (`_reissue`), even when it raises."""
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:  # the caller's filters apply to what is caught,
            # but those naming these modules: each is judged by them when issued again at the caller's line
            warnings.filterwarnings("always", module=r"multimesh\.(parallelize|autolayout\.(front|building))$")
            return fn(*args, **kwargs)
    finally:
        _reissue(caught)


def _reissue(pending: list) -> None:
    """Each warning again; one that names the wrappers' lines (the run layer warns at its caller, which is
    one of them) names the line that called `parallelize` instead."""
    for w in pending:
        if w.filename in _WRAPPERS:
            warnings.warn(w.message, stacklevel=5)  # _reissue, _call, parallelize, keyword_hints, its caller
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
