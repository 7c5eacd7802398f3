"""`task`: a sub-computation placed on a submesh, as a differentiable marker in the trace.

Calling a task inside a trace binds `task_call_p`, a primitive that carries the
task's closed jaxpr and its `Placement`. Under differentiation a
`jax.custom_vjp` splits it into a forward task, which also returns the
flattened `jax.vjp` residuals it computed (residuals that are its own inputs
are passed on as they are, not copied), and a backward task on the same
placement that consumes them: the backward never recomputes the forward unless the user asks
(`jax.checkpoint` inside the task). Lowered as a plain inline call, so a
function of tasks also runs as one ordinary program (the reference).

Called eagerly outside `parallelize`, a task simply runs on its submesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.donation import DonatedArrayError, deleted_paths
from ..core.meshes import constrain, explicit_axes
from ..core.nonarrays import non_arrays
from ..core.placement import Placement, current_placement, use_placement
from ..core.rules import MeshAxes, Rules, identity_rules
from ..core.transfer import reshard_to
from .pmap_axes import axes_of_one_in_force, with_axes_of_one
from .scopes import microbatch_iterations, scope_stack
from .taskspec import Task, TaskMesh, current_global_mesh

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
    return jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)


def _in_caller_mesh(aval: Any) -> Any:
    """A task's output as its caller's trace types it. On Auto axes a type's sharding holds only its mesh
    (the partitioner chooses the rest), but JAX refuses to mix meshes of different sizes in one trace (a
    gradient's transpose, say): an output typed on the task's submesh is retyped on the caller's mesh. On
    Explicit axes the type is the layout, and stays (`parallelize` traces such pipelines on their stages'
    mesh)."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or mesh.empty or explicit_axes(mesh):
        return aval
    caller = jax.sharding.get_abstract_mesh()
    if caller == mesh:
        return aval
    return aval.update(sharding=NamedSharding(caller, PartitionSpec(*[None] * aval.ndim)))


task_call_p.def_impl(_eval)
task_call_p.def_abstract_eval(lambda *args, jaxpr, **_: [_in_caller_mesh(v.aval) for v in jaxpr.jaxpr.outvars])
mlir.register_lowering(task_call_p, mlir.lower_fun(_eval, multiple_results=True))

_IGNORED: contextvars.ContextVar[bool] = contextvars.ContextVar("multimesh_ignore_transforms", default=False)


@contextlib.contextmanager
def ignore_transforms(ignore: bool = True):
    """Tasks and microbatching become no-ops (``ignore=True``): the plain one-program reference.

    ``ignore_transforms(False)`` turns them back on inside an ignoring block.
    """
    token = _IGNORED.set(bool(ignore))
    try:
        yield
    finally:
        _IGNORED.reset(token)


def transforms_ignored() -> bool:
    return _IGNORED.get()


def _is_float(x: Any) -> bool:
    return jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.inexact)


def _bind(placement: Placement, kind: str, fn: Callable[..., list], *flat: Any) -> list:
    if names := axes_of_one_in_force():  # pmap's axes in the step: bound in the task's own jaxpr too
        fn = with_axes_of_one(fn, names)
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
            # A residual that is one of the task's own inputs (a weight, say) is not returned: the backward
            # reads the input itself, instead of a copy the forward would make for every microbatch.
            position = {id(x): i for i, x in enumerate(leaves)}
            info["forwarded"] = [position.get(id(r)) for r in residuals]
            return list(out) + [r for r, i in zip(residuals, info["forwarded"]) if i is None]

        outs = _bind(placement, "fwd", forward, *leaves)
        made = iter(outs[info["n_out"] :])
        residuals = [next(made) if i is None else leaves[i] for i in info["forwarded"]]
        return outs[: info["n_out"]], residuals

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
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))


def _eager_call(placement: Placement, fun: Callable, args: tuple) -> Any:
    """Outside any trace: move the arguments onto the submesh and run there."""

    def put(x):
        if isinstance(x, jax.Array) and x.sharding.device_set <= placement.devices:
            return x
        return reshard_to(x, placement.mesh)

    def scoped(*a):
        with use_placement(placement):
            return fun(*a)

    deleted = [f"argument {i}" + ("" if p == "(the whole tree)" else f" leaf {p!r}")
               for i, a in enumerate(args) for p in deleted_paths(a)]
    if deleted:  # JAX would say only "Array has been deleted with shape=..."
        raise DonatedArrayError(
            f"task {placement.name!r} was called with deleted array(s): {', '.join(deleted[:3])}"
            f"{' ...' if len(deleted) > 3 else ''}: a step built with "
            f"donate=True frees the state it is given, so use the state it returned (loss, state = "
            f"step(state, batch)), or build the step with donate=False to keep the old one")
    inputs = jax.tree.map(put, args)
    if jax.sharding.get_abstract_mesh().empty:
        return jax.jit(scoped)(*inputs)
    with jax.set_mesh(placement.mesh):  # JAX's mesh in context (the global one, say) is not the submesh's
        return jax.jit(scoped)(*inputs)


def make_placement(
    name: str, mesh: Mesh | None, devices: Any, device_axes: Sequence[str] | None, logical_axes: Any
) -> Placement:
    if mesh is not None and (devices is not None or device_axes is not None):
        raise ValueError(f"task {name!r}: give mesh= or devices=/device_axes=, not both")
    if mesh is not None and not isinstance(mesh, Mesh):
        hint = f"build_mesh({mesh!r}, devices)" if isinstance(mesh, Mapping) else "build_mesh({axis: size}, devices)"
        raise TypeError(f"task {name!r}: mesh= must be a jax.sharding.Mesh or a TaskMesh, got "
                        f"{type(mesh).__name__} {mesh!r}; make one with multimesh.jax.{hint}, or give "
                        f"devices= and device_axes=")
    if isinstance(device_axes, str):
        raise TypeError(f"task {name!r}: device_axes must be a sequence of axis names, got the string "
                        f"{device_axes!r}; write ({device_axes!r},) for one axis")
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
    """``devices`` as an array of jax devices: integer ids are looked up; none, or repeats, are refused."""
    arr = np.asarray(devices, dtype=object)
    if arr.size == 0:  # JAX's device list aborts the interpreter on an empty one: refuse it here
        raise ValueError(f"task {name!r}: devices={devices!r} is empty; give at least one device (e.g. "
                         f"devices=jax.devices()[:4], or integer ids), or leave devices= out to span all devices")
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
    fun: Callable | type | None = None,
    name: str | None = None,
    *,
    task: Task | None = None,
    mesh: Mesh | TaskMesh | None = None,
    devices: Any = None,
    device_axes: Sequence[str] | None = None,
    logical_axes: Iterable[tuple[str, MeshAxes]] | None = None,
    mesh_slice: Mapping[str, int] | None = None,
    extra_axes: Iterable[tuple[str, MeshAxes]] | None = None,
    split_backprop: tuple[str, str] | None = None,
    loop_dependent_mesh_slice: Callable[[int], Mapping[str, int]] | None = None,
    out_shardings: Any = None,
    configure: Callable[..., Any] | None = None,
    configure_args: Any = None,
) -> Callable:
    """Run ``fun`` as a task on a submesh (MPMD).

    Args:
      fun: the computation (any pytrees in and out), or a class whose
        instances' ``__call__`` runs as the task. Without it, a decorator.
      name: shown in plans and errors (default: ``fun.__name__``).
      mesh: the task's `Mesh`, or a `TaskMesh` (MultiMesh v0.2); or
      devices: a numpy array of devices (or integer device ids) shaped as the
        submesh (a flat list is 1-D), with ``device_axes`` naming each
        dimension. A device may appear once.
      logical_axes: ``(logical, device_axis)`` pairs, the task's rules
        (default: each device axis maps to itself).
      task: a `Task` saying all of the above (MultiMesh v0.2); ``mesh_slice``,
        ``extra_axes``, ``split_backprop`` and ``loop_dependent_mesh_slice``
        are its fields, given here as keywords (``task(f, mesh_slice={"stage": 1})``).
      out_shardings: a `PartitionSpec` (logical names, resolved by the task's
        rules), `NamedSharding` or None per output (a prefix tree of the
        outputs): constraints on what the task returns.
      configure: a function returning a context manager, entered (called with
        ``configure_args``: a mapping as keywords, a tuple as positional
        arguments, anything else as one argument) while the task's body runs
        or is traced; e.g. ``configure=jax.default_matmul_precision,
        configure_args="float32"``.
    Neither ``mesh`` nor ``devices``: all devices in 1-D (axis ``"devices"``;
    ``"x"`` for the v0.2 forms).
    """
    options = {"task": task, "mesh": mesh, "devices": devices, "device_axes": device_axes,
               "logical_axes": logical_axes, "mesh_slice": mesh_slice, "extra_axes": extra_axes,
               "split_backprop": split_backprop, "loop_dependent_mesh_slice": loop_dependent_mesh_slice,
               "out_shardings": out_shardings, "configure": configure, "configure_args": configure_args}
    if fun is None:
        return lambda f: _make_task(f, name, options)
    return _make_task(fun, name, options)


def _make_task(fun: Callable | type, name: str | None, options: dict) -> Callable:
    label: str = name if name else getattr(fun, "__name__", "task")
    resolve = _placement_source(label, options)
    out_shardings = options["out_shardings"]
    configured = _configured(label, options["configure"], options["configure_args"])
    if isinstance(fun, type):
        return _task_class(fun, label, resolve, out_shardings, configured)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return _run_task(fun, resolve, out_shardings, configured, args, kwargs)

    static = resolve(None) if not getattr(resolve, "lazy", False) else None
    wrapped.placement = static  # type: ignore[attr-defined]
    return wrapped


def _run_task(fun: Callable, resolve: Callable, out_shardings: Any, configured: Callable, args: tuple,
              kwargs: dict | None = None) -> Any:
    if transforms_ignored():
        with configured():
            return fun(*args, **(kwargs or {}))
    if kwargs:  # keyword arguments travel as one more (last) positional pytree: traced like the others
        fun, args = _keywords_last(fun), (*args, kwargs)
    iterations: Sequence[int | None] = microbatch_iterations() or [_current_iteration()]
    placement = resolve(iterations[0])
    # One trace serves every microbatch: check each one's slice now. A loop-dependent task's copy for
    # microbatch i is moved onto its own slice by the planner (plan.loop_slices).
    for i in iterations[1:]:
        resolve(i)
    _check_not_nested(placement)
    body = _with_outputs(fun, placement, out_shardings, configured)
    if _is_tracing(args):
        return _traced_call(placement, body, args)
    return _eager_call(placement, body, args)


def _keywords_last(fun: Callable) -> Callable:
    """``fun`` called as ``(*args, kwargs)``: its keyword arguments as a last positional dict."""

    def call(*args: Any) -> Any:
        return fun(*args[:-1], **args[-1])

    return call


def _task_class(cls: type, label: str, resolve: Callable, out_shardings: Any, configured: Callable) -> type:
    """A subclass of ``cls`` whose instances' ``__call__`` runs as the task (MultiMesh accepts classes)."""
    if any(c.__module__.startswith("flax.linen") for c in cls.__mro__):
        raise TypeError(f"task({cls.__name__}): a Flax Linen Module class runs as a task through "
                        f"multimesh.jax.flax.task({cls.__name__}, ...), which keeps its parameters")
    call = next((c.__dict__["__call__"] for c in cls.__mro__ if "__call__" in c.__dict__), None)
    if call is None:
        raise TypeError(f"task({cls.__name__}): the class has no __call__ to run as the task")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _run_task(functools.partial(call, self), resolve, out_shardings, configured, args, kwargs)

    __call__.__doc__ = call.__doc__
    sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
    sub.placement = resolve(None) if not getattr(resolve, "lazy", False) else None  # type: ignore[attr-defined]
    return sub


def _placement_source(label: str, options: dict) -> Callable[[int | None], Placement]:
    """``f(iteration) -> Placement``: fixed now, or (slices of the global mesh) found when the task runs."""
    spec = options["task"]
    v2 = {k: options[k] for k in ("mesh_slice", "extra_axes", "split_backprop", "loop_dependent_mesh_slice")
          if options[k] is not None}
    if spec is not None or v2 or isinstance(options["mesh"], TaskMesh):
        if spec is not None:
            if not isinstance(spec, Task):
                raise TypeError(f"task {label!r}: task= must be a multimesh Task, got {spec!r}")
            if v2 or any(options[k] is not None for k in ("mesh", "devices", "device_axes", "logical_axes")):
                raise ValueError(f"task {label!r}: task= says where the task runs; give it alone, or the "
                                 f"placement keywords without it")
        else:
            if options["devices"] is not None or options["device_axes"] is not None:
                raise ValueError(f"task {label!r}: devices=/device_axes= do not combine with mesh=TaskMesh(...) "
                                 f"or mesh_slice=; a TaskMesh names its devices and axes")
            spec = Task(name=label, mesh=options["mesh"], logical_axes=options["logical_axes"], **v2)
        if not spec.needs_global_mesh():
            fixed = spec.placement(label)
            return lambda iteration: fixed
        cache: dict = {}

        def lazy(iteration: int | None) -> Placement:
            gm = current_global_mesh()
            key = (id(gm), gm, iteration if spec.loop_dependent_mesh_slice is not None else None)
            if key not in cache:
                cache[key] = spec.placement(label, iteration=key[2])
            return cache[key]

        lazy.lazy = True  # type: ignore[attr-defined]
        return lazy
    fixed = make_placement(label, options["mesh"], options["devices"], options["device_axes"], options["logical_axes"])
    return lambda iteration: fixed


def _configured(label: str, configure: Callable | None, args: Any) -> Callable[[], Any]:
    if configure is None:
        if args is not None:
            raise ValueError(f"task {label!r}: configure_args= without configure=")
        return contextlib.nullcontext
    if not callable(configure):
        raise TypeError(f"task {label!r}: configure must be a function returning a context manager, got {configure!r}")

    def enter() -> Any:
        if args is None:
            cm = configure()
        elif isinstance(args, Mapping):
            cm = configure(**args)
        elif isinstance(args, tuple):
            cm = configure(*args)
        else:
            cm = configure(args)
        if not (hasattr(cm, "__enter__") and hasattr(cm, "__exit__")):
            raise TypeError(f"task {label!r}: configure(...) returned {cm!r}, not a context manager")
        return cm

    return enter


def _with_outputs(fun: Callable, placement: Placement, out_shardings: Any, configured: Callable) -> Callable:
    """``fun`` under its configuration, its outputs constrained to ``out_shardings`` (resolved on ``placement``)."""

    def body(*args: Any) -> Any:
        with configured():
            out = fun(*args)
        bad = non_arrays(out, "output")
        if bad:  # JAX would name our wrapper; name the task
            raise TypeError(
                f"task {placement.name!r} returned {bad}; a task runs as a traced program on its submesh and may "
                f"only return arrays and numbers (in any pytree). Return other values (strings, objects) from "
                f"outside the task, or make them arrays (jnp.asarray)"
            )
        if out_shardings is None:
            return out
        return _constrain_outputs(out, out_shardings, placement)

    return body


def _constrain_outputs(out: Any, shardings: Any, placement: Placement) -> Any:
    def is_spec(s: Any) -> bool:
        return s is None or isinstance(s, (PartitionSpec, NamedSharding))

    def one(leaf: Any, s: Any) -> Any:
        if s is None:
            return leaf
        if isinstance(s, PartitionSpec):
            s = placement.sharding(tuple(s), np.shape(leaf))
        return constrain(leaf, s)

    if is_spec(shardings):
        return jax.tree.map(lambda leaf: one(leaf, shardings), out)
    try:
        return jax.tree.map(lambda s, sub: jax.tree.map(lambda leaf: one(leaf, s), sub), shardings, out,
                            is_leaf=is_spec)
    except ValueError as e:
        raise ValueError(f"task {placement.name!r}: out_shardings must be a prefix of the outputs' tree: {e}") from None


_MICROBATCH_SCOPE = re.compile(r"microbatch_(\d+)")


def _current_iteration() -> int | None:
    """The `microbatch` iteration being traced (its named scope), or None."""
    found = _MICROBATCH_SCOPE.findall(scope_stack())
    return int(found[-1]) if found else None
