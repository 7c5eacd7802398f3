"""`task`: a sub-computation placed on a submesh, as a differentiable marker in the trace.

Calling a task inside a trace binds `task_call_p`, a primitive that carries the
task's closed jaxpr and its `Placement`. Under differentiation a
`jax.custom_vjp` splits it into a forward task, which also returns the
flattened `jax.vjp` residuals, and a backward task on the same placement that
consumes them: the backward never recomputes the forward unless the user asks
(`jax.checkpoint` inside the task). Lowered as a plain inline call, so a
function of tasks also runs as one ordinary program (the reference).

Called eagerly outside `parallelize`, a task simply runs on its submesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core as jcore
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import Mesh

from ..core.placement import Placement, current_placement, use_placement
from ..core.rules import MeshAxes, Rules, identity_rules
from ..core.transfer import reshard_to

__all__ = [
    "DEFAULT_AXIS",
    "Placement",
    "ignore_transforms",
    "make_placement",
    "task",
    "task_call_p",
    "transforms_ignored",
]

DEFAULT_AXIS = "devices"


# -- the primitive -----------------------------------------------------------------

task_call_p = Primitive("task_call")
task_call_p.multiple_results = True


def _eval(*args, jaxpr, placement, kind):
    return jcore.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)


task_call_p.def_impl(_eval)
task_call_p.def_abstract_eval(lambda *args, jaxpr, **_: [v.aval for v in jaxpr.jaxpr.outvars])
mlir.register_lowering(task_call_p, mlir.lower_fun(_eval, multiple_results=True))

_IGNORED: contextvars.ContextVar[bool] = contextvars.ContextVar("multimesh_ignore_transforms", default=False)


@contextlib.contextmanager
def ignore_transforms():
    """Tasks and microbatching become no-ops: the plain one-program reference."""
    token = _IGNORED.set(True)
    try:
        yield
    finally:
        _IGNORED.reset(token)


def transforms_ignored() -> bool:
    return _IGNORED.get()


def _is_float(x: Any) -> bool:
    return jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.inexact)


def _bind(placement: Placement, kind: str, fn: Callable[..., list], *flat: Any) -> list:
    with use_placement(placement):
        closed = jax.make_jaxpr(fn)(*flat)
    return task_call_p.bind(*flat, jaxpr=closed, placement=placement, kind=kind)


def _traced_call(placement: Placement, fun: Callable, args: tuple) -> Any:
    """Bind the task into the current trace, differentiably."""
    flat, in_tree = jax.tree.flatten(args)
    floats = [i for i, x in enumerate(flat) if _is_float(x)]
    info: dict[str, Any] = {}

    def run(*leaves):
        out = fun(*jax.tree.unflatten(in_tree, leaves))
        out_flat, info["out_tree"] = jax.tree.flatten(out)
        return out_flat

    @jax.custom_vjp
    def call(*leaves):
        return _bind(placement, "call", run, *leaves)

    def fwd(*leaves):
        def forward(*leaves):
            def of_floats(*fl):
                full = list(leaves)
                for i, v in zip(floats, fl):
                    full[i] = v
                return run(*full)

            out, vjp = jax.vjp(of_floats, *[leaves[i] for i in floats])
            residuals, info["vjp_tree"] = jax.tree.flatten(vjp)
            info["n_out"] = len(out)
            info["out_float"] = [_is_float(o) for o in out]
            info["out_shapes"] = [np.shape(o) for o in out]
            return list(out) + residuals

        outs = _bind(placement, "fwd", forward, *leaves)
        return outs[: info["n_out"]], outs[info["n_out"] :]

    def bwd(residuals, cts):
        float_cts = [c for c, f in zip(cts, info["out_float"]) if f]

        def backward(*args):
            res, fcts = args[: len(residuals)], iter(args[len(residuals) :])
            vjp = jax.tree.unflatten(info["vjp_tree"], res)
            full = [
                next(fcts) if f else np.zeros(shape, jax.dtypes.float0)
                for f, shape in zip(info["out_float"], info["out_shapes"])
            ]
            return list(vjp(full))

        grads = iter(_bind(placement, "bwd", backward, *residuals, *float_cts))
        out = [None] * len(flat)
        for i in floats:
            out[i] = next(grads)
        return tuple(out)

    call.defvjp(fwd, bwd)
    out_flat = call(*flat)
    return jax.tree.unflatten(info["out_tree"], out_flat)


def _is_tracing(args: Iterable) -> bool:
    return any(isinstance(x, jcore.Tracer) for x in jax.tree.leaves(args))


def _eager_call(placement: Placement, fun: Callable, args: tuple) -> Any:
    """Outside any trace: move the arguments onto the submesh and run there."""

    def put(x):
        if isinstance(x, jax.Array) and x.sharding.device_set <= placement.devices:
            return x
        return reshard_to(x, placement.mesh)

    def scoped(*a):
        with use_placement(placement):
            return fun(*a)

    return jax.jit(scoped)(*jax.tree.map(put, args))


def make_placement(
    name: str, mesh: Mesh | None, devices: Any, device_axes: Sequence[str] | None, logical_axes: Any
) -> Placement:
    if mesh is not None and (devices is not None or device_axes is not None):
        raise ValueError(f"task {name!r}: give mesh= or devices=/device_axes=, not both")
    if mesh is None:
        if devices is None:
            if device_axes is not None and len(tuple(device_axes)) != 1:
                raise ValueError(
                    f"task {name!r}: without devices= the task spans all devices in 1-D, so device_axes "
                    f"must name one axis, got {tuple(device_axes)}"
                )
            if logical_axes is not None and device_axes is None:
                raise ValueError(
                    f"task {name!r}: logical_axes= needs axes to map to; give mesh= or devices= with device_axes="
                )
            devices = jax.devices()
        arr = _as_devices(name, devices)
        axes = tuple(device_axes) if device_axes is not None else ((DEFAULT_AXIS,) if arr.ndim == 1 else None)
        if axes is None or len(axes) != arr.ndim:
            raise ValueError(
                f"task {name!r}: devices has shape {arr.shape} ({arr.ndim} dimensions) but device_axes "
                f"names {0 if axes is None else len(axes)}: {axes}; give one axis name per dimension"
            )
        mesh = Mesh(arr, axes)
    rules = Rules(logical_axes) if logical_axes is not None else identity_rules(mesh.axis_names)
    rules.check_mesh(dict(mesh.shape))
    return Placement(mesh, rules, name=name)


def _as_devices(name: str, devices: Any) -> np.ndarray:
    """``devices`` as an array of jax devices: integer ids are looked up; repeats are refused."""
    arr = np.asarray(devices, dtype=object)
    by_id = {d.id: d for d in jax.devices()}
    flat = []
    for d in arr.flat:
        if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
            if int(d) not in by_id:
                raise ValueError(f"task {name!r}: device id {int(d)} does not exist; ids are {sorted(by_id)}")
            d = by_id[int(d)]
        elif not isinstance(d, jax.Device):
            raise TypeError(f"task {name!r}: devices must be jax devices or integer ids, got {d!r}")
        flat.append(d)
    ids = [d.id for d in flat]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"task {name!r}: devices {repeated} appear more than once in devices={ids}; "
                         f"a submesh holds each device once")
    out = np.empty(arr.shape, dtype=object)
    out.flat[:] = flat
    return out


def _check_not_nested(placement: Placement) -> None:
    """A task called while another task's body is traced must run on the same devices."""
    outer = current_placement()
    if outer is not None and outer.name is not None and not outer.defer and outer.devices != placement.devices:
        raise ValueError(
            f"task {placement.name!r} ({placement.describe()}) is called inside task {outer.name!r} "
            f"({outer.describe()}), on other devices; a task's body runs on its own submesh. Call "
            f"{placement.name!r} outside {outer.name!r} (chain the two in the step), or give it the same devices"
        )


def task(
    fun: Callable | None = None,
    name: str | None = None,
    *,
    mesh: Mesh | None = None,
    devices: Any = None,
    device_axes: Sequence[str] | None = None,
    logical_axes: Iterable[tuple[str, MeshAxes]] | None = None,
) -> Callable:
    """Run ``fun`` as a task on a submesh (MPMD).

    Args:
      fun: the computation (any pytrees in and out). Without it, a decorator.
      name: shown in plans and errors (default: ``fun.__name__``).
      mesh: the task's `Mesh`; or
      devices: a numpy array of devices (or integer device ids) shaped as the
        submesh (a flat list is 1-D), with ``device_axes`` naming each
        dimension. A device may appear once.
      logical_axes: ``(logical, device_axis)`` pairs, the task's rules
        (default: each device axis maps to itself).
    Neither ``mesh`` nor ``devices``: all devices in 1-D (axis ``"devices"``).
    """
    if fun is None:
        return lambda f: task(f, name, mesh=mesh, devices=devices, device_axes=device_axes, logical_axes=logical_axes)
    label = name or getattr(fun, "__name__", "task")
    placement = make_placement(label, mesh, devices, device_axes, logical_axes)

    @functools.wraps(fun)
    def wrapped(*args: Any) -> Any:
        if transforms_ignored():
            return fun(*args)
        _check_not_nested(placement)
        if _is_tracing(args):
            return _traced_call(placement, fun, args)
        return _eager_call(placement, fun, args)

    wrapped.placement = placement  # type: ignore[attr-defined]
    return wrapped
