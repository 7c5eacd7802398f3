"""Derive the sharding of every leaf of an abstract pytree.

Per leaf, the first source that has something to say wins:
1. Flax metadata on the leaf (Linen boxes, NNX variables);
2. a per-path rule (`PathRules`);
3. the leaf's own sharding, when the code that made it gave it one on a
   mesh with Explicit axes (``jax.random.normal(..., out_sharding=P(...))``):
   its type says where it lives;
4. a `with_sharding_constraint` that the traced function applies to the leaf;
5. the ``default`` logical spec (batches: leading dimension ``"batch"``);
otherwise the leaf is replicated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from .jaxprs import subjaxprs
from .metadata import Annotation, map_with_annotations
from .placement import Placement
from .rules import Dropped, PathRules, RuleError

__all__ = ["Layout", "LeafLayout", "constrained_inputs", "derive_layout", "own_spec"]


@dataclass(frozen=True)
class LeafLayout:
    """The placement of one array: what it is, what was asked, what it got."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    logical: tuple | PartitionSpec | None
    source: str
    #: a NamedSharding, or for an argument given on one device (an `mjit` estimate of a pmap-style step)
    #: its SingleDeviceSharding
    sharding: Sharding

    @property
    def spec(self) -> PartitionSpec:
        """Its spec over the mesh (one device's array: ``P()``, the whole array there)."""
        return self.sharding.spec if isinstance(self.sharding, NamedSharding) else PartitionSpec()

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Its mesh's axis sizes (one device's array: none)."""
        return dict(self.sharding.mesh.shape) if isinstance(self.sharding, NamedSharding) else {}

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def bytes_per_device(self) -> int:
        shard = self.sharding.shard_shape(self.shape) if self.shape else ()
        return int(np.prod(shard, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Layout:
    """Shardings of a pytree (same structure, boxes kept) and a record per leaf."""

    shardings: Any
    leaves: tuple[LeafLayout, ...]
    #: Warnings about the rules that laid it out (a logical name without a rule, a rule matching nothing).
    advice: tuple[str, ...] = ()

    def by_path(self) -> dict[str, LeafLayout]:
        return {leaf.path: leaf for leaf in self.leaves}


def derive_layout(
    abstract: Any,
    placement: Placement | Callable[[int], Placement],
    *,
    path_rules: PathRules | None = None,
    constraints: Mapping[int, PartitionSpec | tuple] | None = None,
    default: tuple | None = None,
    exact: bool = False,
    what: str = "parameter",
) -> Layout:
    """Shardings for every leaf of ``abstract`` on ``placement.mesh``.

    ``constraints`` maps flat leaf indices to the specs of constraints found by
    `constrained_inputs`. ``placement`` may be a function of the flat leaf index
    (MPMD: each input lives on the submesh of its first consumer). ``exact=True`` makes a logical dimension that a mesh
    axis does not divide an error (batches: silently replicating a batch
    dimension would make data parallelism a lie).
    """
    path_rules = path_rules or PathRules()
    constraints = constraints or {}
    records: list[LeafLayout] = []
    counter = iter(range(1 << 62))

    placement_for = placement if callable(placement) else (lambda _: placement)

    def place(path: str, leaf: Any, ann: Annotation | None) -> NamedSharding:
        index = next(counter)
        where = placement_for(index)
        shape = tuple(getattr(leaf, "shape", ()))
        dtype = getattr(leaf, "dtype", np.float32)
        label = f"{what} {path!r}" if path else what
        if ann is None or ann.spec is None:
            matched = path_rules.match(path)
            own = own_spec(leaf)
            if matched is not None:
                ann = Annotation(matched, "path rule", physical=isinstance(matched, PartitionSpec))
            elif own is not None:
                ann = Annotation(own, "its own sharding", physical=True)
            elif index in constraints:
                spec = constraints[index]
                ann = Annotation(spec, "constraint in fun", physical=isinstance(spec, PartitionSpec))
            elif default is not None and shape:
                ann = Annotation(tuple(default)[: len(shape)], "default")
            else:
                ann = Annotation(None, "none")
        given = ann.spec
        if ann.physical:
            if not isinstance(given, PartitionSpec):
                raise TypeError(f"the {label}'s annotation ({ann.source}) says mesh axes, so it must be a "
                                f"PartitionSpec, but it is {given!r}")
            try:
                sharding = where.physical(given, shape, path=label, logical_fallback=ann.source != "path rule")
            except RuleError as e:
                if ann.source != "path rule":
                    raise
                raise RuleError(f"{e} (a PartitionSpec in param_rules names mesh axes; give a tuple of logical "
                                f"names, e.g. {tuple(given)[: len(shape)]}, to have the rules resolve them)") from None
        else:
            if isinstance(given, PartitionSpec):
                raise TypeError(f"the {label}'s annotation ({ann.source}) says logical names, so it must be a "
                                f"tuple, but it is the PartitionSpec {given}")
            resolved = where.rules.resolution(given, where.axis_sizes, shape, path=label)
            if exact and resolved.dropped and given is not None:  # no spec drops nothing
                _check_exact(given, resolved.dropped[0], shape, where, label)
            sharding = NamedSharding(where.mesh, resolved.spec)
        records.append(LeafLayout(path, shape, dtype, ann.spec, ann.source, sharding))
        return sharding

    shardings = map_with_annotations(place, abstract)
    return Layout(shardings, tuple(records))


def own_spec(leaf: Any) -> PartitionSpec | None:
    """The spec an abstract leaf's type carries, when it names a mesh axis (explicit sharding), else None."""
    sharding = getattr(leaf, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not isinstance(spec, PartitionSpec) or not any(e is not None and e is not PartitionSpec.UNCONSTRAINED
                                                      for e in spec):
        return None
    return spec


def _check_exact(logical: tuple, dropped: Dropped, shape: tuple, placement: Placement, label: str) -> None:
    """Raise because divisibility made the rules drop mesh axes from dimension ``dropped.dim``."""
    d, axes = dropped.dim, dropped.wanted
    size = math.prod(placement.axis_sizes[a] for a in axes)
    raise RuleError(
        f"dimension {d} ({logical[d]!r}) of the {label} has size {shape[d]}, which does not "
        f"divide over mesh axes {axes} (total size {size}); make it a multiple of {size} "
        f"or use fewer devices on those axes"
    )


def constrained_inputs(jaxpr: jax.extend.core.Jaxpr) -> dict[int, PartitionSpec | tuple]:
    """Input index -> spec of the first `with_sharding_constraint` applied directly to it.

    A resolved constraint gives its `PartitionSpec` (mesh axes); a deferred one
    (`Placement.defer`) its logical spec, a tuple, for the rules of the submesh
    where the input lands.

    Follows inputs into nested calls (jit, remat, custom derivatives) whose
    operands line up with their inner jaxpr's inputs.
    """
    found: dict[int, PartitionSpec | tuple] = {}
    walked: set[tuple] = set()  # a body called once per microbatch on the same inputs is read once

    def walk(jaxpr, owner: dict) -> None:
        key = (id(jaxpr), frozenset(owner.items()))
        if key in walked:
            return
        walked.add(key)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("sharding_constraint", "logical_constraint"):
                var = eqn.invars[0]
                if var in owner and owner[var] not in found:
                    spec = eqn.params["spec"] if eqn.primitive.name == "logical_constraint" \
                        else getattr(eqn.params.get("sharding"), "spec", None)
                    if spec is not None:
                        found[owner[var]] = spec
                continue
            for sub in subjaxprs(eqn):
                if len(sub.invars) == len(eqn.invars):
                    inner = {iv: owner[ov] for iv, ov in zip(sub.invars, eqn.invars) if _hashable(ov) and ov in owner}
                    if inner:
                        walk(sub, inner)

    walk(jaxpr, {v: i for i, v in enumerate(jaxpr.invars)})
    return found


def _hashable(v) -> bool:
    return not isinstance(v, jax.extend.core.Literal)
