"""JAX's refusals of a step's mesh axes, explained by the mesh `parallelize` (or `mjit`) traced it on.

Two meshes a newcomer gets without asking surprise code written for another:

* an ``{axis: size}`` shape is built with Auto axes (what Flax Linen's logical
  rules need; `core.meshes.build_mesh`), and code in JAX's explicit-sharding
  style (``out_sharding=P("fsdp", ...)``, ``jax.sharding.reshard``) needs its
  axes Explicit: JAX says "PartitionSpec passed to ... cannot contain axis
  names that are of type Auto";
* without ``mesh=`` (and no `MultiMesh` in force) the mesh is 1-D
  ``{"data": <all devices>}``, and code that names other axes gets JAX's
  "Resource axis: fsdp of ... is not found in mesh: ('data',)", also when
  registered tasks' submeshes have those axes (the step is traced on the whole
  mesh before it is split over them).

`explained_mesh_errors` turns those into errors that name the mesh used and
what to pass instead, the original chained as the cause.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from jax.sharding import AxisType, Mesh

from ..core.fmt import device_span

__all__ = ["MeshAxesError", "explained_mesh_errors"]


class MeshAxesError(ValueError):
    """JAX refused the code's mesh axes on the mesh `parallelize` used; the cause is JAX's own error."""

_SPEC_TEXT = r"(?:P|PartitionSpec)\([^()]*\)"
_SPEC = re.compile(_SPEC_TEXT)
_AUTO = re.compile(r"axis name: (\w+) of type: AxisType\.(?:Auto|Manual)")
_GOT = re.compile(rf"Got (?P<spec>{_SPEC_TEXT})")
_MISSING = re.compile(rf"Resource axis: \w+ of (?P<spec>{_SPEC_TEXT}) is not found in mesh")


def _shape(mesh: Mesh) -> str:
    return "{" + ", ".join(f"{a!r}: {n}" for a, n in mesh.shape.items()) + "}"


def _make_mesh(names: tuple[str, ...], sizes: tuple[int, ...]) -> str:
    explicit = "(AxisType.Explicit,)" if len(names) == 1 else f"(AxisType.Explicit,) * {len(names)}"
    return f"jax.make_mesh({sizes!r}, {names!r}, axis_types={explicit})"


def _spec_axes(spec: str) -> tuple[str, ...]:
    """The mesh axis names a printed PartitionSpec names, in order: ``P('fsdp', None, 'tp')`` -> fsdp, tp."""
    return tuple(dict.fromkeys(re.findall(r"'(\w+)'", spec)))


def _named(text: str) -> tuple[tuple[str, ...], str] | None:
    """(the mesh axes, the spec as printed) that JAX's refusal ``text`` names; None when it is none of them."""
    if (m := _AUTO.search(text)) and "cannot contain axis names" in text:
        spec = _SPEC.search(text)
        return (m.group(1),), spec.group(0) if spec else f"P({m.group(1)!r})"
    if (m := _MISSING.search(text)) or ("not under a mesh context" in text and (m := _GOT.search(text))):
        return _spec_axes(m.group("spec")), m.group("spec")
    return None


def explain(error: BaseException, mesh: Mesh, given: Any, who: str = "parallelize") -> MeshAxesError | None:
    """A clearer error for JAX's refusal ``error`` of the code's mesh axes on ``mesh``, built from ``given``
    (what ``mesh=`` was: None for the default, a shape, or the mesh); None when it is not one. ``who``: the
    entry point that traced the step, as the message names it."""
    found = _named(str(error))
    if found is None:
        return None
    axes, spec = found
    names, sizes = tuple(mesh.axis_names), tuple(mesh.shape.values())
    if missing := [a for a in axes if a not in names]:
        devices = device_span(d.id for d in mesh.devices.flat)
        if given is None:
            which = (f"{who}'s default mesh {_shape(mesh)} (1-D over devices {devices}: no mesh= was given "
                     f"and no MultiMesh is in force)")
        else:
            which = f"the mesh {_shape(mesh)} (devices {devices})"
        return MeshAxesError(
            f"{who}: the code names mesh axis {missing[0]!r} ({spec}), but the step is traced on {which}, "
            f"which has no axis {missing[0]!r}; a pipeline's step too is traced on that mesh before it is split "
            f"over the tasks' submeshes. Pass mesh= a mesh over those {mesh.size} devices with the axes the code "
            f"names ({', '.join(map(repr, axes))}): an {{axis: size}} shape gives Auto axes, and code in JAX's "
            f"explicit-sharding style needs jax.make_mesh(sizes, {axes!r}, axis_types=(AxisType.Explicit, ...))")
    auto = [a for a in axes if mesh.axis_types[names.index(a)] == AxisType.Auto]
    if not auto:
        return None  # a task's submesh, say: not the mesh parallelize was given
    if isinstance(given, Mesh):
        how = "was made with Auto axes (jax.sharding.Mesh's default)"
    else:
        how = ("was made from an {axis: size} shape, which gives Auto axes (as Flax Linen's logical rules need) "
               "unless jax.set_mesh puts a mesh of typed axes in context")
    return MeshAxesError(
        f"{who}: the code uses JAX's explicit sharding ({spec} naming mesh axis {auto[0]!r} in "
        f"out_sharding=, jax.sharding.reshard or the like), which needs Explicit axes, but the mesh "
        f"{_shape(mesh)} {how}. Pass a mesh of Explicit axes instead: mesh={_make_mesh(names, sizes)} "
        f"(from jax.sharding import AxisType)")


@contextlib.contextmanager
def explained_mesh_errors(mesh: Mesh, given: Any, who: str = "parallelize") -> Iterator[None]:
    """Inside, JAX's refusal of the step's mesh axes (`explain`) is raised as an error naming ``mesh``."""
    try:
        yield
    except (ValueError, RuntimeError) as e:
        better = explain(e, mesh, given, who)
        if better is None:
            raise
        raise better from e
