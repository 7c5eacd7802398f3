"""Building meshes and submeshes from devices, with errors that say what is wrong."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .._compat.jax import trace_state_clean

__all__ = ["abstract_mesh_context", "auto_meshes_in_context", "build_mesh", "constrain", "context_axis_types",
           "drop_axes", "explicit_axes", "mesh_context", "mesh_devices", "no_mesh_context", "place_mesh",
           "slice_mesh", "spec_names"]

MeshLike = Mesh | Mapping[str, int] | None


def _device_array(devices: Any | None) -> np.ndarray:
    """``devices`` as an object array of `jax.Device` (integer ids looked up), or a clear error."""
    if devices is None:
        return np.asarray(jax.devices(), dtype=object)
    if isinstance(devices, (str, bytes, jax.Device)):
        raise TypeError(f"devices must be a sequence or array of jax devices (or integer ids), got {devices!r}")
    arr = np.asarray(devices, dtype=object)
    if arr.size == 0:
        raise ValueError("devices is empty; give at least one device")
    by_id = {d.id: d for d in jax.devices()}
    flat = []
    for d in arr.flat:
        if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
            if int(d) not in by_id:
                raise ValueError(f"devices: device id {int(d)} does not exist; ids are {sorted(by_id)}")
            d = by_id[int(d)]
        elif not isinstance(d, jax.Device):
            raise TypeError(f"devices must be jax devices or integer ids, got {d!r} ({type(d).__name__})")
        flat.append(d)
    if len(set(flat)) != len(flat):
        raise ValueError(f"devices lists a device more than once: {flat}")
    out = np.empty(arr.shape, dtype=object)
    out.flat[:] = flat
    return out


def build_mesh(mesh: MeshLike = None, devices: Any | None = None, *, default_axis: str = "data") -> Mesh:
    """A `Mesh` from a mesh, an ``{axis: size}`` shape, or nothing (1-D over the devices).

    A shape is built with the axis types of the mesh in context
    (``jax.set_mesh``) for the axes it shares with it, else Auto (what Flax
    Linen's logical rules need). A ``-1`` size takes the remaining devices.
    """
    if isinstance(mesh, Mesh):
        if devices is not None:
            given = list(_device_array(devices).flat)
            if set(given) != set(mesh.devices.flat):
                raise ValueError(
                    f"mesh {dict(mesh.shape)} is over devices {sorted(d.id for d in mesh.devices.flat)}, but "
                    f"devices= names {sorted(d.id for d in given)}; give one of the two"
                )
        return mesh
    devs = _device_array(devices)
    if mesh is None:
        return Mesh(devs.reshape(-1), (default_axis,))
    if not isinstance(mesh, Mapping) or not mesh:
        raise TypeError(f"mesh must be a jax.sharding.Mesh or a mapping {{axis_name: size}}, got {mesh!r}")
    names = tuple(mesh)
    bad = {a: s for a, s in mesh.items() if not isinstance(s, (int, np.integer)) or isinstance(s, bool)}
    if bad:
        axis, size = next(iter(bad.items()))
        raise TypeError(f"mesh shape {dict(mesh)}: the size of axis {axis!r} must be an int (-1: the remaining "
                        f"devices), got {size!r}")
    sizes = [int(s) for s in mesh.values()]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh shape {dict(mesh)} has more than one -1")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if devs.size % known:
            raise ValueError(f"{devs.size} devices do not fit mesh shape {dict(mesh)}: {devs.size} % {known} != 0"
                             f"{_simulate_hint(known)}")
        sizes[sizes.index(-1)] = devs.size // known
    if any(s < 1 for s in sizes):
        raise ValueError(f"mesh shape {dict(mesh)} has a size below 1")
    if math.prod(sizes) != devs.size:
        raise ValueError(
            f"{devs.size} devices do not fit mesh shape {dict(zip(names, sizes))}, which needs "
            f"{math.prod(sizes)}; change the shape or pass devices=jax.devices()[:{math.prod(sizes)}]"
            f"{_simulate_hint(math.prod(sizes))}"
        )
    return Mesh(devs.reshape(-1).reshape(sizes), names, axis_types=context_axis_types(names))


def _simulate_hint(needed: int) -> str:
    """On a CPU with too few devices: how to simulate ``needed`` of them."""
    if jax.default_backend() != "cpu" or jax.device_count() >= needed:
        return ""
    return (f" (this machine has {jax.device_count()} CPU device(s); to simulate {needed}, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} before JAX starts)")


def context_axis_types(names: Sequence[str]) -> tuple:
    """The axis types that the mesh in context (``jax.set_mesh``) gives ``names``; Auto for the others."""
    context = jax.sharding.get_abstract_mesh()
    types = dict(zip(context.axis_names, context.axis_types)) if not context.empty else {}
    return tuple(types.get(n, AxisType.Auto) for n in names)


def mesh_devices(mesh: Mesh) -> frozenset:
    return frozenset(mesh.devices.flat)


def slice_mesh(mesh: Mesh, axis: str) -> list[Mesh]:
    """One submesh per index along ``axis`` (e.g. one per pipeline stage), without that axis."""
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh {dict(mesh.shape)} has no axis {axis!r}")
    i = mesh.axis_names.index(axis)
    rest = tuple(n for n in mesh.axis_names if n != axis)
    subs = []
    for k in range(mesh.devices.shape[i]):
        devs = np.take(mesh.devices, k, axis=i)
        subs.append(Mesh(devs, rest) if rest else Mesh(np.asarray(devs).reshape(1), ("devices",)))
    return subs


def place_mesh(shape: Mapping[str, int] | Sequence[int], devices: Sequence,
               axis_names: Sequence[str] | None = None) -> Mesh:
    """A mesh of ``shape`` over other ``devices`` (e.g. the same stage shape on the next device group)."""
    if isinstance(shape, Mapping):
        axis_names, sizes = tuple(shape), tuple(shape.values())
    else:
        sizes = tuple(shape)
        if axis_names is None or len(axis_names) != len(sizes):
            raise ValueError(f"give one axis name per dimension of {sizes}, got {axis_names}")
    return build_mesh(dict(zip(axis_names, sizes)), devices)


@contextlib.contextmanager
def mesh_context(mesh: Mesh | None) -> Iterator[None]:
    """JAX's mesh in context (``jax.set_mesh``) as code running on ``mesh`` needs it; None: no change.

    A mesh with Explicit axes is put in context: code in JAX's explicit-sharding
    style (``out_sharding=P(...)``, ``jax.sharding.reshard``) resolves its
    specs there. A mesh of Auto axes only is not (Flax would then apply its
    boxes' names as constraints itself, while multimesh resolves them by the
    rules of wherever they run), unless `auto_meshes_in_context` is in force
    (a step whose own code needs it), but a different mesh the caller put in
    context is taken out of it: computations on other devices than the
    context's are refused by `jax.jit`. Inside a trace JAX allows only its
    abstract mesh to be set, which is what tracing reads.
    """
    if mesh is None:
        yield
        return
    context = jax.sharding.get_abstract_mesh()
    if explicit_axes(mesh) or (_AUTO_IN_CONTEXT.get() and context != mesh.abstract_mesh):
        target = mesh
    elif context.empty or context == mesh.abstract_mesh:
        yield
        return
    else:
        target = None
    if not trace_state_clean():  # only the abstract mesh may be set inside a trace
        if target is not None and not context.empty and explicit_axes(context):
            # Values traced so far are typed on the context's mesh, and ops refuse to mix meshes: a task's body
            # traced inside a step on a whole Explicit mesh stays there (`parallelize` traces a pipeline again,
            # on its stages' mesh, for its programs).
            yield
            return
        with abstract_mesh_context(target):
            yield
        return
    with jax.set_mesh(target):
        yield


_AUTO_IN_CONTEXT: contextvars.ContextVar[bool] = contextvars.ContextVar("auto_meshes_in_context", default=False)


@contextlib.contextmanager
def auto_meshes_in_context() -> Iterator[None]:
    """`mesh_context` puts meshes of Auto axes in context too, while this is in force: for code that names mesh
    axes in a bare `PartitionSpec` (``jax.lax.with_sharding_constraint(x, P("data", None))``), which JAX
    resolves on the mesh in context, each placement's own (a task's code sees its submesh)."""
    token = _AUTO_IN_CONTEXT.set(True)
    try:
        yield
    finally:
        _AUTO_IN_CONTEXT.reset(token)


@contextlib.contextmanager
def abstract_mesh_context(mesh: Any) -> Iterator[None]:
    """``mesh`` (a `Mesh`, `AbstractMesh` or None: no mesh) as the abstract mesh in context, inside a trace.

    JAX lets a trace change its mesh's size only by way of no mesh; multimesh does so where one trace holds
    several submeshes (a task's body, a pipeline stage's segment of a step traced on the whole mesh).
    """
    with jax.sharding.use_abstract_mesh(_NO_MESH):
        if mesh is None:
            yield
            return
        with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)):
            yield


_NO_MESH = jax.sharding.AbstractMesh((), ())


def explicit_axes(mesh: Any) -> frozenset[str]:
    """The axes of ``mesh`` (concrete or abstract) whose type is Explicit."""
    types = getattr(mesh, "axis_types", None) or ()
    return frozenset(n for n, t in zip(mesh.axis_names, types) if t == AxisType.Explicit)


def spec_names(spec: Iterable[Any] | None) -> set[str]:
    """The names a `PartitionSpec` (or a tuple of logical names) uses: mesh axes, or logical names."""
    out: set[str] = set()
    for entry in spec or ():
        if isinstance(entry, str):
            out.add(entry)
        elif isinstance(entry, (tuple, list)):
            out.update(n for n in entry if isinstance(n, str))
    return out


def drop_axes(spec: PartitionSpec, drop: frozenset[str]) -> PartitionSpec:
    """``spec`` without the mesh axes ``drop`` (a dimension left with none is replicated)."""
    if not drop:
        return spec
    out: list[Any] = []
    for entry in spec:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            out.append(entry)
            continue
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in drop)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*out)


def constrain(x: Any, sharding: NamedSharding) -> Any:
    """Put traced ``x`` in ``sharding``: `jax.lax.with_sharding_constraint` on Auto axes, and on Explicit
    axes (which JAX's constraint refuses) `jax.sharding.reshard`, which changes the array's type. A
    constraint on Explicit axes of another mesh than the one in context is left out (see below)."""
    explicit = explicit_axes(sharding.mesh)
    if not explicit:
        return jax.lax.with_sharding_constraint(x, sharding)
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and explicit_axes(context) and context != sharding.mesh.abstract_mesh:
        # A task's constraint while a pipeline is first traced on its whole mesh, where the task's values are
        # typed: `parallelize` traces the step again on its stages' mesh, where the constraint applies.
        return x
    auto = frozenset(sharding.mesh.axis_names) - explicit
    x = jax.sharding.reshard(x, NamedSharding(sharding.mesh, drop_axes(sharding.spec, auto)))
    if auto:
        x = jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, drop_axes(sharding.spec, explicit)))
    return x


@contextlib.contextmanager
def no_mesh_context() -> Iterator[None]:
    """No mesh in JAX's context (outside a trace): the MPMD runtime's programs each run on their own submesh,
    which a mesh the caller put in context over other devices would make `jax.jit` refuse."""
    if jax.sharding.get_abstract_mesh().empty:
        yield
        return
    with jax.set_mesh(None):
        yield
