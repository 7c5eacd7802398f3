"""Flax Linen's logical constraints (`nn.with_logical_constraint`) resolved by multimesh.

A Linen model hints where its activations go with
``nn.with_logical_constraint(x, ("batch", "length", "embed"))``. Flax resolves
the names with its own rules (the call's ``rules=``, else the
``nn.logical_axis_rules`` / ``nn_partitioning.axis_rules`` context) and
constrains only when a mesh is in context (``jax.set_mesh``, ``with mesh:``);
otherwise the hint does nothing. Under multimesh no JAX mesh is in context
while a step is traced, so every hint would be dropped.

While a placement is in force (`use_placement`), this module routes those
hints to multimesh: each one is resolved as multimesh's own
`with_sharding_constraint` is, on the mesh in force (the step's, a task's
submesh, or the submesh the plan later gives the equation: deferred), with

1. multimesh's rules in force (``parallelize(rules=...)``, a task's
   ``logical_axes``) when they say more than "each mesh axis is itself";
2. else Flax's rules in force (the call's ``rules=`` or Flax's context);
3. else nothing: with no rules anywhere the hint is a no-op, as in Flax.

Flax's own lookup of the rules in force (``nn.logical_to_mesh_axes(names)``,
which MaxText's helpers call to build a `NamedSharding` on their own mesh)
answers multimesh's rules there when Flax has none of its own.

The call's ``mesh=`` is not used: the mesh is the one the equation runs on.
``fallback=`` keeps Flax's meaning: ``NO_CONSTRAINT`` skips a hint that names
a logical name no rule mentions, ``RAISE_ERROR`` raises a ValueError.

Flax also constrains each boxed parameter where a module reads it
(``self.param`` unboxes a `nn.LogicallyPartitioned` or `nn.Partitioned`, under
``nn.scan`` with the scanned axis taken out of its names), but only when it
sees a mesh in context (``flax.core.meta.global_mesh_defined``). A step given
its parameters boxed, as ``model.init`` returns them, gets those constraints
under multimesh too: under a placement a logical box's constraint takes the
road above, and a box of mesh axes (no ``mesh=`` of its own) is constrained
by multimesh on the mesh in force, its names resolved as any spec's (mesh
axes stand for themselves).

How: Flax's `with_logical_constraint` reads its rules and constrains each
leaf through two functions of `flax.linen.spmd` that it looks up when called
(``get_logical_axis_rules`` and ``_with_sharding_constraint_one_fallback``),
and the boxes constrain in their ``unbox`` methods. While any placement is in
force these four are replaced by the routing below, and restored when the last one ends; in a
thread with no placement in force the replacements call Flax's own. Flax has no public hook for this: its rules
context gives rules but not our resolution (divisibility, deferral to the
submesh the plan chooses), and a JAX mesh in context would change what the
rest of the model does.
"""

from __future__ import annotations

from typing import Any

from flax.core import meta as flax_meta
from flax.core import spmd as flax_core_spmd
from flax.linen import spmd as linen_spmd
from jax.sharding import PartitionSpec

from .._compat.flax import linen_constraint_functions, set_linen_constraint_functions
from ..core.placement import current_placement, while_placed
from ..core.rules import RuleError, Rules
from .constraints import constrain_hint, with_sharding_constraint
from .shared_hook import SharedHook

__all__ = ["flax_context_rules", "routing_linen_constraints"]


class _InForce(tuple):
    """What Flax's rule lookup answers under a placement when Flax has no rules: multimesh's rules in force,
    so that the model's own ``nn.logical_to_mesh_axes`` resolves by them (MaxText's sharding helpers build
    their `NamedSharding`s so), or a rule naming nothing; never empty, so that Flax goes on to constrain
    (through us) instead of returning early, and never taken for Flax's own rules."""


_NO_RULE = (("\0multimesh: no rules", None),)


def flax_context_rules(mesh: Any) -> Rules | None:
    """The rules of Flax's ``nn.logical_axis_rules`` / ``nn_partitioning.axis_rules`` context (None outside
    one), checked against ``mesh``: what `parallelize` uses when it is given no ``rules=``."""
    in_context = flax_core_spmd.get_logical_axis_rules()
    if not in_context:
        return None
    rules = Rules(in_context)
    try:
        rules.require_mesh(dict(mesh.shape))
    except RuleError as e:
        raise RuleError(f"{e} (the rule comes from Flax's nn.logical_axis_rules / axis_rules context, which "
                        f"parallelize uses when given no rules=; pass rules= to choose others)") from None
    return rules


def _rules_in_force() -> Any:
    """Replaces `flax.linen.spmd.get_logical_axis_rules`: Flax's rules, or under a placement multimesh's."""
    rules = flax_core_spmd.get_logical_axis_rules()
    placement = current_placement()
    if rules or placement is None:
        return rules
    return _InForce(placement.own_rules.rules or _NO_RULE)


def _constrain_leaf(axis_resources: Any, x: Any, fallback: Any = linen_spmd.RulesFallback.AXIS_IS_UNSHARDED,
                    rules: Any = None, mesh: Any = None) -> Any:
    """Replaces `flax.linen.spmd._with_sharding_constraint_one_fallback`: one leaf of a Linen hint."""
    if current_placement() is None:
        return _FLAX[1](axis_resources, x, fallback=fallback, rules=rules, mesh=mesh)
    if axis_resources is None:
        return x
    flax_rules = None if rules is None or isinstance(rules, _InForce) else Rules(rules).rules  # hashable
    return constrain_hint(x, tuple(axis_resources), flax_rules, linen_spmd.RulesFallback(fallback).value)


def _unbox_partitioned(box: flax_meta.Partitioned, apply_constraint: bool = True) -> Any:
    """Replaces `flax.core.meta.Partitioned.unbox`: a box of mesh axes with no mesh of its own is constrained
    by multimesh on the mesh in force (Flax would ask JAX for a mesh in context, which a placement lacks)."""
    if current_placement() is None or not apply_constraint or box.mesh is not None:
        return _FLAX[2](box, apply_constraint)
    if not _placeable(box, physical=True):
        return box.value
    return with_sharding_constraint(box.value, PartitionSpec(*box.names))


def _unbox_logical(box: linen_spmd.LogicallyPartitioned, apply_constraint: bool = True) -> Any:
    """Replaces `flax.linen.spmd.LogicallyPartitioned.unbox`: a logical box is constrained under a placement
    (Flax would only under a mesh in context), by the road of `nn.with_logical_constraint` above."""
    if current_placement() is None or not apply_constraint or box.mesh is not None:
        return _FLAX[3](box, apply_constraint)
    if not _placeable(box, physical=False):
        return box.value
    return linen_spmd.with_logical_constraint(box.value, box.get_partition_spec(), rules=box.rules)


def _placeable(box: flax_meta.Partitioned, physical: bool) -> bool:
    """Whether the box's names resolve on the placement in force. One that does not is left unconstrained
    here: the parameter's layout reports it, naming the parameter's path. One case is no error: Flax's
    ``DenseGeneral`` unboxes its kernel flattened to 2-D while making it (and again in the abstract shape
    check of every apply), names longer than the value; the kernel it keeps is constrained where it is read."""
    placement = current_placement()
    if placement is None:
        return False
    shape = getattr(box.value, "shape", ())
    try:
        if physical:
            placement.physical(PartitionSpec(*box.names), shape)
        else:
            placement.spec(tuple(box.names), shape)
    except RuleError:
        return False
    return True


_FLAX: list = []  # Flax's own four functions, while ours replace them


def _route_to_multimesh() -> None:
    _FLAX[:] = linen_constraint_functions()
    set_linen_constraint_functions(_rules_in_force, _constrain_leaf, _unbox_partitioned, _unbox_logical)


_ROUTING = SharedHook(_route_to_multimesh, lambda: set_linen_constraint_functions(*_FLAX))


def routing_linen_constraints() -> SharedHook:
    """Linen's logical constraints go to multimesh while the block runs (nested blocks share one routing)."""
    return _ROUTING


while_placed(routing_linen_constraints)
