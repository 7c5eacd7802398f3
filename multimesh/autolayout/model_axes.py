"""The mesh axes a model names itself, which every mesh a search tries must have.

Flax lets a model name mesh axes rather than logical names: Linen's
``nn.with_partitioning`` (``Partitioned`` boxes), NNX variables' sharding
metadata (``out_sharding``, ``sharding_names``), and arrays made with a
sharding of their own on Explicit axes. A name there that `standard_rules`
does not know as a logical name (``embed``, ``mlp``, ...) is an axis of the
model's choosing, such as nanodo's ``data`` or the Gemma example's ``fsdp`` and
``tp``; its code may name it again where no rule can reach
(``einsum(..., out_sharding=P("fsdp", None, "tp"))``). A mesh without it
cannot run that code, so the search gives every mesh these axes, of size 1
where it does not split them. Linen's logical boxes
(``nn.with_logical_partitioning``) name logical names only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from ..core.given_shardings import abstract_outputs
from ..core.layout import own_spec
from ..core.meshes import spec_names
from ..core.metadata import Annotation, map_with_annotations
from ..core.rules import standard_rules

__all__ = ["AxisTypes", "axes_made_explicit", "model_axes"]

#: How a search types its meshes' axes (`axes_made_explicit`).
AxisTypes = Literal["auto", "explicit"] | None

#: The annotation sources whose names are mesh axes in Flax's own meaning (`multimesh.core.metadata`).
_MESH_AXIS_SOURCES = frozenset({"flax-linen", "flax-nnx"})


def model_axes(init_params: Callable[[], Any]) -> tuple[str, ...]:
    """The mesh axes ``init_params``' parameters name themselves, in the order the parameters first name them
    (empty when it cannot be evaluated abstractly on its own: the candidates' builds then say why)."""
    try:
        abstract = abstract_outputs(init_params)   # with the shardings a jit of its own gives them
    except Exception:  # e.g. it makes arrays on a mesh it expects in context; each candidate reports its error
        return ()
    logical = standard_rules(()).generic
    found: dict[str, None] = {}

    def visit(path: str, leaf: Any, ann: Annotation | None) -> Any:
        if ann is not None and ann.spec is not None:
            names = spec_names(ann.spec) if ann.source in _MESH_AXIS_SOURCES or ann.physical else set()
        else:
            names = spec_names(own_spec(leaf))
        found.update((n, None) for n in sorted(names) if n not in logical)
        return leaf

    map_with_annotations(visit, abstract)
    return tuple(found)


def axes_made_explicit(axis_types: AxisTypes, model: tuple[str, ...], axes: tuple[str, ...]) -> frozenset[str] | None:
    """The axes a search's meshes make Explicit: for ``"explicit"`` the model's own (its code's PartitionSpecs
    name them; the search's other axes stay Auto, for XLA to propagate), or every searched axis when it names
    none; for ``"auto"`` none; None: as the mesh in context (`building.layout_mesh`)."""
    if axis_types is None:
        return None
    if axis_types not in ("auto", "explicit"):
        raise ValueError(f"auto_layout: axis_types={axis_types!r}; give 'explicit', 'auto' or None (the types of "
                         f"the mesh in context, jax.set_mesh)")
    if axis_types == "auto":
        return frozenset()
    return frozenset(model or axes)
