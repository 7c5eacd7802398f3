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

The same reading gives the sizes of the dimensions each name labels
(`ModelNames.sizes`): a model whose parameters have an ``expert`` dimension
(a Mixture of Experts, `standard_rules` mapping it to the mesh axis
``expert``) is searched over that axis too, in sizes that divide its experts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from ..core.given_shardings import abstract_outputs
from ..core.layout import own_spec
from ..core.meshes import spec_names
from ..core.metadata import Annotation, map_with_annotations
from ..core.rules import standard_rules

__all__ = ["AxisTypes", "ModelNames", "axes_made_explicit", "model_axes", "model_names"]

#: How a search types its meshes' axes (`axes_made_explicit`).
AxisTypes = Literal["auto", "explicit"] | None

#: The annotation sources whose names are mesh axes in Flax's own meaning (`multimesh.core.metadata`).
_MESH_AXIS_SOURCES = frozenset({"flax-linen", "flax-nnx"})


@dataclasses.dataclass(frozen=True)
class ModelNames:
    """What a model's parameters call their dimensions: the mesh ``axes`` they name themselves (in the order
    they first name them), and per name the ``sizes`` of the dimensions it labels; ``read``: False when the
    initializer could not be evaluated abstractly on its own (then both are empty)."""

    axes: tuple[str, ...] = ()
    sizes: Mapping[str, frozenset[int]] = dataclasses.field(default_factory=dict)
    read: bool = True


def model_names(init_params: Callable[[], Any]) -> ModelNames:
    """`ModelNames` of ``init_params``' parameters (its annotations, or the shardings its arrays carry)."""
    try:
        abstract = abstract_outputs(init_params)   # with the shardings a jit of its own gives them
    except Exception:  # e.g. it makes arrays on a mesh it expects in context; each candidate reports its error
        return ModelNames(read=False)
    logical = standard_rules(()).generic
    found: dict[str, None] = {}
    sizes: dict[str, set[int]] = {}

    def visit(path: str, leaf: Any, ann: Annotation | None) -> Any:
        if ann is not None and ann.spec is not None:
            names = spec_names(ann.spec) if ann.source in _MESH_AXIS_SOURCES or ann.physical else set()
            for size, entry in zip(getattr(leaf, "shape", ()), ann.spec):
                for name in (entry,) if isinstance(entry, str) else tuple(entry or ()):
                    sizes.setdefault(name, set()).add(int(size))
        else:
            names = spec_names(own_spec(leaf))
        found.update((n, None) for n in sorted(names) if n not in logical)
        return leaf

    map_with_annotations(visit, abstract)
    return ModelNames(tuple(found), {name: frozenset(s) for name, s in sizes.items()})


def model_axes(init_params: Callable[[], Any]) -> tuple[str, ...]:
    """The mesh axes ``init_params``' parameters name themselves, in the order the parameters first name them
    (empty when it cannot be evaluated abstractly on its own: the candidates' builds then say why)."""
    return model_names(init_params).axes


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
