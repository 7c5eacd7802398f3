"""`with_sharding_constraint` with logical names, and `shard_map` in both signatures."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.meshes import constrain, drop_axes
from ..core.placement import Placement, current_placement, use_placement
from ..core.rules import MeshAxes, RuleError, Rules, as_axes
from .deferred import logical_constraint_p
from .implicit import placement_in_scope
from .interpret import bind_equation
from .knobs import current_knobs
from .nested import rebind_nested
from .stage_shard_map import on_another_mesh, onto_stage

__all__ = ["constrain_hint", "logical_spec_to_mesh", "resolve_deferred", "shard_map", "with_sharding_constraint"]


def _manual_axes() -> frozenset[str]:
    """Mesh axes that are manual here (inside a `shard_map`)."""
    try:
        return frozenset(jax.sharding.get_abstract_mesh().manual_axes)
    except Exception:  # no abstract mesh in context
        return frozenset()


def _no_mesh_in_context() -> bool:
    return jax.sharding.get_abstract_mesh().empty


def _has_named_sharding(shardings: Any) -> bool:
    leaves = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, (PartitionSpec, NamedSharding)))
    return any(not isinstance(s, PartitionSpec) for s in leaves)


def logical_spec_to_mesh(spec: PartitionSpec, placement: Placement | None = None, shape=None) -> PartitionSpec:
    """Resolve the logical names of ``spec`` with the rules in scope (identity if none)."""
    placement = placement or current_placement()
    if placement is None:
        return spec
    return placement.spec(tuple(spec), shape)


def with_sharding_constraint(x: Any, shardings: Any) -> Any:
    """`jax.lax.with_sharding_constraint` whose `PartitionSpec`s hold logical names.

    Names are resolved by the rules of the enclosing task (or `parallelize`),
    with the array's shape (a mesh axis that does not divide a dimension is
    skipped). Inside a `shard_map` the axes that are manual there are dropped.
    Under ``autoshard(False)`` it is `jax.lax.with_sharding_constraint`. With
    no rules in scope this is exactly `jax.lax.with_sharding_constraint`,
    except that `PartitionSpec`s with no mesh anywhere in context (a model
    run on one device, e.g. as the reference) leave ``x`` as it is, as Flax's
    logical constraints do, instead of raising.
    """
    if current_knobs().autoshard is False:  # MultiMesh's autoshard(False): JAX's own constraint
        return jax.lax.with_sharding_constraint(x, shardings)
    placement = current_placement()
    if placement is None:
        if _no_mesh_in_context() and not _has_named_sharding(shardings):
            return x
        return jax.lax.with_sharding_constraint(x, shardings)
    manual = _manual_axes()
    if placement.defer and not manual and not _has_named_sharding(shardings):  # resolved where it runs
        return _per_leaf(x, shardings, lambda leaf, s: logical_constraint_p.bind(leaf, spec=tuple(s), hint=None))
    if manual and manual >= set(placement.mesh.axis_names):
        return x  # fully manual: nothing left for the compiler to place

    def one(leaf, sharding):
        if isinstance(sharding, NamedSharding):
            return constrain(leaf, sharding)
        if not isinstance(sharding, PartitionSpec):
            return jax.lax.with_sharding_constraint(leaf, sharding)
        spec = drop_axes(placement.spec(tuple(sharding), leaf.shape), manual)
        if manual:  # inside a partially manual shard_map JAX wants a bare spec
            return jax.lax.with_sharding_constraint(leaf, spec)
        return constrain(leaf, NamedSharding(placement.mesh, spec))

    return _per_leaf(x, shardings, one)


def constrain_hint(x: jax.Array, spec: tuple, flax_rules: tuple[tuple[str, MeshAxes], ...] | None = None,
                   fallback: str = "axis_is_unsharded", step_rules: Rules | None = None,
                   step_axes: tuple[tuple[str, int], ...] = ()) -> jax.Array:
    """A Flax Linen hint (``nn.with_logical_constraint``) on one array, resolved on the mesh in force by

    1. multimesh's rules in force, when they say more than "each mesh axis is itself";
    2. else ``step_rules``: the rules of the step that traced the hint (`parallelize`'s), for a hint that
       runs in a task given no ``logical_axes`` of its own (a pipeline stage);
    3. else ``flax_rules`` (the Flax rules the call saw);
    4. else nothing: with no rules anywhere the hint does nothing, as in Flax.

    ``fallback`` is Flax's `RulesFallback` value for names no rule mentions: ``"axis_is_unsharded"``
    (replicated), ``"no_constraint"`` (the hint is skipped), ``"raise_error"``. Deferred, like any logical
    constraint, while the placement is: the rules are chosen where the equation runs. There, a rule naming
    a mesh axis of the step's mesh (``step_axes``: its ``(axis, size)`` pairs) that the running submesh lacks
    is applied without that axis, and a warning names the hint and the axis (if it has more than one device).
    """
    placement = current_placement()
    if placement is None or current_knobs().autoshard is False:
        return x  # Flax's own behaviour with no mesh in context
    if placement.defer and not _manual_axes():
        hint = (flax_rules, fallback, placement.own_rules or None, tuple(placement.mesh.shape.items()))
        return logical_constraint_p.bind(x, spec=tuple(spec), hint=hint)
    mine = placement.own_rules
    rules = mine or step_rules or Rules(flax_rules or ())
    if not rules:
        return x
    known = rules.logical_names | set(placement.mesh.axis_names)
    unknown = [n for d in spec for n in (d if isinstance(d, tuple) else (d,)) if isinstance(n, str) and n not in known]
    if unknown and fallback == "no_constraint":
        return x
    if unknown and fallback == "raise_error":
        raise ValueError(f"nn.with_logical_constraint: logical names {unknown} of {tuple(spec)} have no rule in "
                         f"{rules} (fallback=RAISE_ERROR)")
    if mine:
        return with_sharding_constraint(x, PartitionSpec(*spec))
    rules = _rules_on_submesh(rules, placement, tuple(spec), x, step_axes)
    try:  # Flax's rules in force name the mesh they expect: an axis this mesh lacks is refused at once
        Rules(rules).require_mesh(dict(placement.mesh.shape))
        by_these = Placement(placement.mesh, Rules(rules, strict=placement.rules.strict), placement.name)
    except RuleError as e:
        raise RuleError(f"{e} (a rule of Flax's rules in force, which resolve nn.with_logical_constraint(x, "
                        f"{tuple(spec)}) where multimesh has no rules of its own: give rules= or "
                        f"logical_axes=)") from None
    with use_placement(by_these):
        return with_sharding_constraint(x, PartitionSpec(*spec))


def _rules_on_submesh(rules: Rules, placement: Placement, spec: tuple, x: Any,
                      step_axes: tuple[tuple[str, int], ...]) -> Rules:
    """``rules`` less the mesh axes of the step's mesh that ``placement``'s submesh lacks, with a warning naming
    the hint and the axes where that changes it (an axis of one device changes nothing); a rule left with no
    axis is dropped (the name's next rule applies, as when Flax finds a rule's axes taken). Axes the step's
    mesh lacks too are left: an error."""
    sizes = dict(step_axes)
    lacking = set(sizes) - set(placement.mesh.axis_names)
    if not lacking:
        return rules
    names = {n for d in spec for n in (d if isinstance(d, tuple) else (d,)) if isinstance(n, str)}
    kept, lost = [], []
    for name, axes in rules.rules:
        gone = [a for a in as_axes(axes) if a in lacking]
        if not gone:
            kept.append((name, axes))
            continue
        if name in names and any(sizes[a] > 1 for a in gone):
            lost.append(f"{name!r} -> {', '.join(repr(a) for a in gone if sizes[a] > 1)}")
        left = tuple(a for a in as_axes(axes) if a not in lacking)
        if left:
            kept.append((name, left))
    if lost:
        where = placement.describe() if placement.name else f"the submesh {dict(placement.mesh.shape)}"
        missing = sorted(a for a in lacking if sizes[a] > 1)
        warnings.warn(f"nn.with_logical_constraint(x, {spec}) on {getattr(x, 'aval', x).str_short()} runs on "
                      f"{where}, which lacks mesh ax{'is' if len(missing) == 1 else 'es'} "
                      f"{', '.join(map(repr, missing))} of the step's mesh {sizes}: its rules {'; '.join(lost)} "
                      f"apply without it (give the task logical_axes= for its submesh to choose otherwise)",
                      UserWarning, stacklevel=2)
    return Rules(kept, strict=rules.strict, generic=rules.generic)


def resolve_deferred(eqn: Any, ins: list) -> list:
    """An `interpret` rule: a deferred constraint is resolved with the rules in scope; the rest as is.

    A constraint the user's code made to a `NamedSharding` on other devices than the submesh running it
    (the whole mesh, in a pipeline stage, also a bare spec resolved on it; another stage, for a body JAX
    traced once for two tasks) keeps its spec, resolved on that submesh by its rules; a `shard_map` on
    another mesh runs on that submesh (`stage_shard_map.onto_stage`). Constraints inside
    nested jaxprs (a remat's body, a scan's) are resolved alike (`nested.rebind_nested`).
    """
    if eqn.primitive is logical_constraint_p:
        hint = eqn.params.get("hint")
        if hint is not None:
            return [constrain_hint(ins[0], eqn.params["spec"], *hint)]
        return [with_sharding_constraint(ins[0], PartitionSpec(*eqn.params["spec"]))]
    if eqn.primitive.name == "sharding_constraint" and _on_other_devices(eqn.params.get("sharding")):
        return [with_sharding_constraint(ins[0], eqn.params["sharding"].spec)]
    if on_another_mesh(eqn):  # a shard_map over the model's own mesh: on the running submesh
        return onto_stage(eqn, ins)
    nested = rebind_nested(eqn, ins, resolve_deferred, _to_resolve)
    return nested if nested is not None else bind_equation(eqn, ins)


def _to_resolve(eqn: Any) -> bool:
    """An equation `resolve_deferred` changes: a constraint deferred or on other devices than the running
    submesh, a shard_map on another mesh."""
    return eqn.primitive is logical_constraint_p or (
        eqn.primitive.name == "sharding_constraint" and _on_other_devices(eqn.params.get("sharding"))) or (
        on_another_mesh(eqn))


def _on_other_devices(sharding: Any) -> bool:
    """Whether ``sharding`` is a `NamedSharding` over other devices than the placement in force: a concrete
    mesh of other devices, or an abstract one (a bare spec resolved on the whole mesh in context) of
    another shape than the placement's."""
    placement = current_placement()
    if placement is None or not isinstance(sharding, NamedSharding):
        return False
    mesh = sharding.mesh
    if isinstance(mesh, Mesh):
        return frozenset(mesh.devices.flat) != placement.devices
    return mesh != placement.mesh.abstract_mesh


def _per_leaf(x: Any, shardings: Any, one: Callable) -> Any:
    """``one(leaf, sharding)`` for every leaf: one sharding for all of ``x``, or a tree of them (a prefix of x)."""
    is_spec = lambda s: isinstance(s, (PartitionSpec, NamedSharding))  # noqa: E731
    if is_spec(shardings):
        return jax.tree.map(lambda leaf: one(leaf, shardings), x)
    return jax.tree.map(lambda s, sub: jax.tree.map(lambda leaf: one(leaf, s), sub), shardings, x, is_leaf=is_spec)


_MISSING = object()


def shard_map(
    f: Callable | None = None,
    mesh: Any = None,
    in_specs: Any = _MISSING,
    out_specs: Any = _MISSING,
    check_rep: bool | None = None,
    auto: frozenset | set | None = None,
    *,
    axis_names: frozenset | set | None = None,
    check_vma: bool | None = None,
) -> Callable:
    """`jax.shard_map` that also accepts the former experimental signature.

    * ``shard_map(f, *, out_specs, in_specs=<infer>, mesh=None, axis_names=set(), check_vma=True)``
      (``mesh=None``: the task's submesh, else the mesh of ``jax.set_mesh``);
    * ``shard_map(f, mesh, in_specs, out_specs, check_rep=True, auto=frozenset())``
      (``auto``: axes left to the compiler, i.e. ``axis_names = mesh axes - auto``).

    Without a mesh (or given a `MultiMesh`), inside the scope of a registered
    task (a Flax module or named scope `register_task` matches) the mesh is
    that task's submesh, e.g. its ``mesh_slice`` of the global mesh, as in
    MultiMesh.

    Inside a task or `parallelize`, names in the specs may be logical; they
    are resolved by the rules in scope when the function is called.
    """
    if out_specs is _MISSING:
        raise TypeError("shard_map() needs out_specs")
    if check_rep is not None and check_vma is not None:
        raise TypeError("give check_vma or its former name check_rep, not both")
    if auto is not None and axis_names is not None:
        raise TypeError("give axis_names, or the axes left to the compiler as auto, not both")
    check = True if check_vma is None and check_rep is None else bool(check_vma if check_vma is not None else check_rep)

    def decorate(fun: Callable) -> Callable:
        def wrapped(*args):
            placement = current_placement()
            multi = mesh is not None and not isinstance(mesh, Mesh) and isinstance(getattr(mesh, "mesh", None), Mesh)
            given = None if multi else mesh  # a MultiMesh: its slice for this scope, else its global mesh
            if given is None and (placement is None or placement.defer):
                # inside a registered task's scope (a Flax module, a named scope): that task's submesh
                placement = placement_in_scope() or placement
            if given is None and placement is None and multi:
                given = mesh.mesh
            the_mesh = given if given is not None else (placement.mesh if placement is not None else None)
            names = axis_names
            if auto is not None:
                if the_mesh is None:
                    raise ValueError("shard_map(auto=...) needs a mesh")
                names = set(the_mesh.axis_names) - set(auto)
            resolve = lambda tree: jax.tree.map(  # noqa: E731
                lambda s: logical_spec_to_mesh(s, placement) if isinstance(s, PartitionSpec) else s,
                tree,
                is_leaf=lambda s: isinstance(s, PartitionSpec) or s is None,
            )
            kwargs: dict[str, Any] = dict(out_specs=resolve(out_specs), check_vma=check)
            if in_specs is not _MISSING:
                kwargs["in_specs"] = resolve(in_specs)
            if the_mesh is not None:
                kwargs["mesh"] = the_mesh
            if names:
                kwargs["axis_names"] = frozenset(names)
            return jax.shard_map(fun, **kwargs)(*args)

        wrapped.__name__ = getattr(fun, "__name__", "shard_mapped")
        wrapped.__doc__ = getattr(fun, "__doc__", None)
        return wrapped

    return decorate if f is None else decorate(f)
