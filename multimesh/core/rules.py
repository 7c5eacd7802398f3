"""Logical axis rules: logical names on array dimensions -> a `PartitionSpec`.

Pure Python; no devices are touched. One algorithm serves parameters,
activations, batches, Flax Linen and Flax NNX metadata alike.

Vocabulary
----------
* A **logical spec** names each dimension of an array: a logical name
  (``"batch"``), ``None`` (replicated), or a tuple of names (one dimension that
  merges several logical axes). ``PartitionSpec.UNCONSTRAINED`` passes through.
* **Rules** are an ordered sequence of ``(logical_name, mesh_axes)`` pairs;
  ``mesh_axes`` is a mesh axis name, a tuple of them, or ``None`` (explicitly
  replicated).

The algorithm
-------------
Rules are tried in order; the order is the priority, across all dimensions
(exactly as in ``flax.linen.logical_to_mesh_axes``). For a rule
``(name, axes)`` and the dimension ``d`` named ``name``:

1. if ``name`` has been *closed* on ``d`` (a ``None`` rule for it matched), skip;
2. if any of ``axes`` is already used by this array (on any dimension), skip:
   a mesh axis shards at most one dimension once;
3. if the product of the sizes of ``axes`` and of the axes already on ``d``
   does not divide ``d``'s size, skip (strict mode: error);
4. otherwise append ``axes`` to ``d``'s mesh axes.

A rule ``(name, None)`` closes ``d``: later rules for ``name`` do not apply.
So a later rule for the same name is a *fallback* when the earlier one was
skipped, and *stacks* when both apply. A dimension that no rule assigns stays
replicated; in strict mode a name that has no rule at all (not even a ``None``
one) is an error. A mesh axis that the mesh does not have is always an error.

Worked examples (mesh ``{"data": 4, "fsdp": 2, "model": 2}``)::

    rules = [("batch", "data"), ("batch", "fsdp"), ("embed", "fsdp"), ("mlp", "model")]

    ("batch", "embed")  shape (16, 8)  -> P(("data", "fsdp"), None)
        batch stacks data and fsdp; fsdp is then taken, so embed is replicated.
    ("embed", "mlp")    shape (8, 6)   -> P("fsdp", "model")
    ("batch", None)     shape (6, 3)   -> P("fsdp", None)
        4 does not divide 6, so "data" is skipped and "fsdp" is the fallback.
    (("heads", "kv"),)  with rules [("heads", "model"), ("kv", "fsdp")]
                                       -> P(("model", "fsdp"),)

Per-path rules (`PathRules`) give a logical spec (a tuple of names, resolved
by the rules) or a physical one (a `PartitionSpec`, used as is) to every
parameter whose ``/``-joined path matches a regular expression (``re.search``,
first match wins). They serve models that carry no logical metadata.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from jax.sharding import PartitionSpec

__all__ = [
    "RULE_SETS",
    "Dropped",
    "LogicalSpec",
    "MeshAxes",
    "PathRules",
    "Resolution",
    "RuleError",
    "RuleWarning",
    "Rules",
    "as_axes",
    "named_rules",
    "resolution",
    "resolve",
    "standard_rules",
]

MeshAxes = Union[str, tuple[str, ...], None]
LogicalDim = Union[str, tuple[str, ...], None, Any]
LogicalSpec = Sequence[LogicalDim]


class RuleError(ValueError):
    """A logical spec cannot be resolved with the given rules and mesh."""


class RuleWarning(UserWarning):
    """A rule that cannot apply on this mesh (it names a mesh axis the mesh lacks), used by no array yet."""


def as_axes(axes: MeshAxes) -> tuple[str, ...]:
    """A rule's mesh axes as a tuple (None: none)."""
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def _where(path: str | None) -> str:
    return f" of {path!r}" if path else ""


@dataclass(frozen=True)
class Rules:
    """An ordered, validated set of ``(logical_name, mesh_axes)`` rules.

    ``strict=True`` turns silent decisions into errors: a dimension that a
    rule's mesh axes do not divide, and a logical name that no rule mentions.
    ``generic``: logical names these rules cover as generic defaults
    (`standard_rules`: every name it knows, a rule or not on this mesh);
    `parallelize` warns about a name without a rule, or a rule that matches
    nothing, only for other names.
    """

    rules: tuple[tuple[str, MeshAxes], ...] = ()
    strict: bool = False
    generic: frozenset[str] = frozenset()

    def __init__(self, rules: Iterable[tuple[str, MeshAxes]] | Rules = (), *, strict: bool = False,
                 generic: Iterable[str] = ()):
        generic = frozenset(generic)
        if isinstance(rules, Rules):
            strict = strict or rules.strict
            generic = generic | rules.generic
            rules = rules.rules
        if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
            raise RuleError(f"rules must be a sequence of (logical_name, mesh_axes) pairs, got {rules!r}")
        if isinstance(rules, Mapping):  # order matters and a name may have several rules: pairs, not a dict
            raise RuleError(f"rules must be a sequence of (logical_name, mesh_axes) pairs, got the dict {rules!r}; "
                            f"write list(rules.items()) if one mesh axis per name is meant")
        normalised = []
        for i, rule in enumerate(rules):
            if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
                raise RuleError(
                    f"rule #{i} is {rule!r}; each rule must be a pair (logical_name, mesh_axes)"
                )
            name, axes = rule
            if not isinstance(name, str):
                raise RuleError(f"rule #{i} {rule!r}: the logical name must be a str, got {type(name).__name__}")
            if axes is not None and not isinstance(axes, str):
                if not isinstance(axes, (tuple, list)):
                    raise RuleError(f"rule #{i} {rule!r}: mesh axes must be str, a tuple of str, or None")
                axes = tuple(axes)
                if not all(isinstance(a, str) for a in axes):
                    raise RuleError(f"rule #{i} {rule!r}: mesh axes must be str, a tuple of str, or None")
                if len(set(axes)) != len(axes):
                    raise RuleError(f"rule #{i} {rule!r} names a mesh axis twice; "
                                    f"a mesh axis shards one dimension once")
                if not axes:
                    axes = None  # () means no mesh axes: replicated, as in Linen
            normalised.append((name, axes))
        object.__setattr__(self, "rules", tuple(normalised))
        object.__setattr__(self, "strict", strict)
        object.__setattr__(self, "generic", generic)

    def __iter__(self):
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def __add__(self, other: Iterable[tuple[str, MeshAxes]]) -> Rules:
        other = Rules(other)
        return Rules(self.rules + other.rules, strict=self.strict, generic=self.generic | other.generic)

    def __repr__(self) -> str:
        body = ", ".join(f"{n!r}->{a!r}" for n, a in self.rules)
        return f"Rules([{body}]{', strict=True' if self.strict else ''})"

    @property
    def logical_names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.rules)

    @property
    def mesh_axes(self) -> frozenset[str]:
        return frozenset(a for _, axes in self.rules for a in as_axes(axes))

    def unknown_axes(self, axis_sizes: Mapping[str, int]) -> list[tuple[tuple[str, MeshAxes], str]]:
        """``(rule, mesh axis)`` for each rule naming a mesh axis that the mesh does not have."""
        return [((name, axes), a) for name, axes in self.rules for a in as_axes(axes) if a not in axis_sizes]

    def check_mesh(self, axis_sizes: Mapping[str, int]) -> None:
        """Warn (`RuleWarning`) about each rule naming a mesh axis that the mesh does not have: harmless
        while no array uses the rule's logical name (as in MultiMesh), a `RuleError` once one does."""
        for (name, axes), axis in self.unknown_axes(axis_sizes):
            warnings.warn(RuleWarning(
                f"rule ({name!r}, {axes!r}) names mesh axis {axis!r}, but the mesh has axes {dict(axis_sizes)}: "
                f"an array whose spec names {name!r} is refused; fix the rule or build the mesh with that axis "
                f"if one is meant to"), stacklevel=2)

    def require_mesh(self, axis_sizes: Mapping[str, int]) -> None:
        """Raise if a rule names a mesh axis that the mesh does not have, used or not."""
        for (name, axes), axis in self.unknown_axes(axis_sizes):
            raise RuleError(
                f"rule ({name!r}, {axes!r}) names mesh axis {axis!r}, but the mesh has "
                f"axes {dict(axis_sizes)}; fix the rule or build the mesh with that axis"
            )

    def resolve(
        self,
        spec: LogicalSpec | None,
        axis_sizes: Mapping[str, int],
        shape: Sequence[int] | None = None,
        *,
        path: str | None = None,
    ) -> PartitionSpec:
        """Resolve a logical spec to a `PartitionSpec` (see the module docstring)."""
        return resolve(spec, self, axis_sizes, shape, path=path)

    def resolution(
        self,
        spec: LogicalSpec | None,
        axis_sizes: Mapping[str, int],
        shape: Sequence[int] | None = None,
        *,
        path: str | None = None,
    ) -> Resolution:
        """`resolve`, and the mesh axes that divisibility dropped (see `resolution`)."""
        return resolution(spec, self, axis_sizes, shape, path=path)


@dataclass(frozen=True)
class Dropped:
    """Mesh axes that a dimension's rules named but its size did not let it have.

    ``axes``: those the dimension did not get. ``wanted``: every mesh axis its
    applicable rules gave it, applied or dropped, in rule order (what the
    dimension would hold if its size divided; its product is the size to divide).
    """

    dim: int
    axes: tuple[str, ...]
    wanted: tuple[str, ...]


@dataclass(frozen=True)
class Resolution:
    """What `resolution` found: the `PartitionSpec`, and one `Dropped` per dimension
    (in dimension order) from which divisibility kept mesh axes (never in strict mode: there it is an error)."""

    spec: PartitionSpec
    dropped: tuple[Dropped, ...] = ()


def resolve(
    spec: LogicalSpec | None,
    rules: Rules | Iterable[tuple[str, MeshAxes]],
    axis_sizes: Mapping[str, int],
    shape: Sequence[int] | None = None,
    *,
    path: str | None = None,
    strict: bool | None = None,
) -> PartitionSpec:
    """Resolve the logical ``spec`` of an array of ``shape`` on a mesh.

    Args:
      spec: one entry per leading dimension (may be shorter than the rank).
      rules: ordered ``(logical_name, mesh_axes)`` pairs.
      axis_sizes: the mesh's axis sizes, e.g. ``dict(mesh.shape)``.
      shape: the array's shape; without it, divisibility is not checked.
      path: the array's path, named in error messages.
      strict: override ``rules.strict``.

    `resolution` takes the same arguments and also says which mesh axes
    divisibility dropped.
    """
    return resolution(spec, rules, axis_sizes, shape, path=path, strict=strict).spec


def resolution(
    spec: LogicalSpec | None,
    rules: Rules | Iterable[tuple[str, MeshAxes]],
    axis_sizes: Mapping[str, int],
    shape: Sequence[int] | None = None,
    *,
    path: str | None = None,
    strict: bool | None = None,
) -> Resolution:
    """`resolve`, with the mesh axes that a dimension's size made the rules skip (`Resolution.dropped`).

    A dimension that nothing was dropped from is not listed; without ``shape``
    nothing is ever dropped.
    """
    rules = Rules(rules) if not isinstance(rules, Rules) else rules
    strict = rules.strict if strict is None else strict
    if strict:
        rules.require_mesh(axis_sizes)
    if spec is None:
        return Resolution(PartitionSpec())
    if isinstance(spec, PartitionSpec):
        spec = tuple(spec)
    spec = tuple(spec)
    if shape is not None and len(spec) > len(shape) and _shards_nothing(spec):
        spec = spec[: len(shape)]  # (None,) on a scalar (an optimizer's step count): replicated, as asked
    if shape is not None and len(spec) > len(shape):
        raise RuleError(
            f"logical spec {spec} of rank {len(spec)} is longer than the rank {len(shape)} "
            f"of the array{_where(path)} with shape {tuple(shape)}"
        )

    # Each dimension holds a list of logical names (a tuple dim merges several).
    dim_names: list[tuple[str, ...] | None] = []
    seen: dict[str, int] = {}
    for d, entry in enumerate(spec):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            dim_names.append(None)
            continue
        names = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
        for n in names:
            if not isinstance(n, str):
                raise RuleError(f"logical spec {spec}{_where(path)}: dimension {d} has non-str name {n!r}")
            if n in seen:
                raise RuleError(
                    f"logical spec {spec}{_where(path)} names {n!r} on dimensions {seen[n]} and {d}; "
                    f"a logical name may appear once per array"
                )
            seen[n] = d
        dim_names.append(names)

    if strict:
        unknown = sorted(set(seen) - rules.logical_names)
        if unknown:
            raise RuleError(
                f"strict rules: logical name {unknown[0]!r} of the array{_where(path)} (spec {spec}) has "
                f"no rule; add ({unknown[0]!r}, <mesh axes>) or ({unknown[0]!r}, None) to replicate"
            )

    assigned: list[list[str]] = [[] for _ in spec]
    wanted: list[list[str]] = [[] for _ in spec]  # assigned or dropped, in rule order
    dropped: set[int] = set()
    closed: set[tuple[int, str]] = set()
    used: set[str] = set()
    for name, axes in rules:
        dim = seen.get(name)
        if dim is None or (dim, name) in closed:
            continue
        if axes is None:
            closed.add((dim, name))
            continue
        axes_t = as_axes(axes)
        missing = [a for a in axes_t if a not in axis_sizes]
        if missing:
            raise RuleError(
                f"rule ({name!r}, {axes!r}) names mesh axis {missing[0]!r}, but the mesh has axes "
                f"{dict(axis_sizes)}, and the array{_where(path)} (spec {spec}) names {name!r}; fix the rule "
                f"or build the mesh with that axis"
            )
        if used.intersection(axes_t):
            continue
        wanted[dim].extend(a for a in axes_t if a not in wanted[dim])
        if shape is not None:
            size = shape[dim]
            factor = math.prod(axis_sizes[a] for a in assigned[dim] + list(axes_t))
            if size % factor:
                if strict:
                    raise RuleError(
                        f"strict rules: dimension {dim} ({name!r}, size {size}) of the array{_where(path)} "
                        f"with shape {tuple(shape)} is not divisible by mesh axes {axes_t} "
                        f"(total size {factor}); pad the dimension, change the mesh, or drop the rule"
                    )
                dropped.add(dim)
                continue
        assigned[dim].extend(axes_t)
        used.update(axes_t)

    out: list[Any] = []
    for entry, axes in zip(spec, assigned):
        if entry is PartitionSpec.UNCONSTRAINED:
            out.append(entry)
        elif not axes:
            out.append(None)
        elif len(axes) == 1:
            out.append(axes[0])
        else:
            out.append(tuple(axes))
    lost = tuple(
        Dropped(d, tuple(a for a in wanted[d] if a not in assigned[d]), tuple(wanted[d])) for d in sorted(dropped)
    )
    return Resolution(PartitionSpec(*out), lost)


def check_physical(
    spec: PartitionSpec, axis_sizes: Mapping[str, int], shape: Sequence[int] | None, *, path: str | None = None
) -> PartitionSpec:
    """Validate a `PartitionSpec` of mesh axes against a mesh and an array shape (one that shards nothing,
    e.g. ``P(None)`` matching every path and a scalar among them, is replicated whatever its length)."""
    if shape is not None and len(spec) > len(shape) and _shards_nothing(tuple(spec)):
        spec = PartitionSpec(*tuple(spec)[: len(shape)])
    if shape is not None and len(spec) > len(shape):
        raise RuleError(
            f"PartitionSpec {spec} is longer than the rank {len(shape)} of the array{_where(path)} "
            f"with shape {tuple(shape)}"
        )
    used: set[str] = set()
    for d, entry in enumerate(spec):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        axes = as_axes(entry)
        for a in axes:
            if a not in axis_sizes:
                raise RuleError(
                    f"PartitionSpec {spec} of the array{_where(path)} names mesh axis {a!r}, "
                    f"but the mesh has axes {dict(axis_sizes)} and no rule maps {a!r} as a logical name; "
                    f"name a mesh axis, or add a rule ({a!r}, <mesh axis>) (a task's logical_axes=)"
                )
            if a in used:
                raise RuleError(
                    f"PartitionSpec {spec} of the array{_where(path)} uses mesh axis {a!r} twice; "
                    f"a mesh axis may shard one dimension once"
                )
            used.add(a)
        if shape is not None:
            factor = math.prod(axis_sizes[a] for a in axes)
            if shape[d] % factor:
                raise RuleError(
                    f"dimension {d} (size {shape[d]}) of the array{_where(path)} with shape {tuple(shape)} "
                    f"is not divisible by mesh axes {axes} (total size {factor}) in {spec}"
                )
    return spec


def _shards_nothing(spec: tuple) -> bool:
    """Whether every dimension of ``spec`` is None (replicated)."""
    return all(entry is None for entry in spec)


@dataclass(frozen=True)
class PathRules:
    """Specs by parameter path: ``[(regex, spec), ...]``, first ``re.search`` match wins.

    ``spec`` is a logical spec (tuple of logical names, resolved by the rules)
    or a `PartitionSpec` of mesh axes (used as is, after validation).
    """

    patterns: tuple[tuple[re.Pattern, Any], ...] = ()

    def __init__(self, patterns: Iterable[tuple[str | re.Pattern, Any]] | Mapping[str, Any] | PathRules = ()):
        if isinstance(patterns, PathRules):
            patterns = patterns.patterns
        elif isinstance(patterns, Mapping):
            patterns = patterns.items()
        compiled = []
        for regex, spec in patterns:
            try:
                compiled.append((re.compile(regex), spec))
            except re.error as e:
                raise RuleError(f"path rule {regex!r} is not a valid regular expression: {e}") from None
        object.__setattr__(self, "patterns", tuple(compiled))

    def match(self, path: str) -> Any | None:
        for regex, spec in self.patterns:
            if regex.search(path):
                return spec
        return None

    def __len__(self) -> int:
        return len(self.patterns)

    def __repr__(self) -> str:
        body = ", ".join(f"{r.pattern!r}: {s!r}" for r, s in self.patterns)
        return f"PathRules({{{body}}})"


def identity_rules(axis_names: Iterable[str]) -> Rules:
    """Each mesh axis maps to itself (a task's default rules)."""
    return Rules([(a, a) for a in axis_names])


def standard_rules(axis_names: Iterable[str], *, strict: bool = False, sequence: bool = False) -> Rules:
    """Sensible rules for a transformer on a mesh with some of the axes
    ``data``, ``fsdp``, ``expert``, ``tensor``/``model``, ``stage``.

    Batch goes over data, fsdp and expert; parameters' ``embed`` over fsdp; a
    Mixture of Experts' ``expert`` dimension over expert (each device of the axis
    holds its share of the experts, and its own tokens elsewhere); the
    Megatron dimensions (``mlp``, ``heads``, ``kv_heads``, ``vocab``) over the
    tensor axis. Only axes the mesh has are named. These names, and
    ``length``, ``kv``, ``head_dim`` and ``norm`` (left whole), are the rules'
    ``generic`` names: no warning says they have no rule on a mesh.

    ``sequence``: also split activations' ``length`` over the tensor axis
    where nothing else of the array uses it (Megatron's sequence parallelism:
    the residual stream and norms between blocks hold 1/tensor of the
    sequence, which XLA gathers over the tensor axis where a block needs it
    whole). The rule comes last, so the Megatron dimensions keep the tensor
    axis where an array has both.
    """
    names = set(axis_names)
    tensor = "tensor" if "tensor" in names else ("model" if "model" in names else None)
    wanted: list[tuple[str, MeshAxes]] = [
        ("batch", "data"),
        ("batch", "fsdp"),
        ("batch", "expert"),
        ("embed", "fsdp"),
        ("expert", "expert"),
        ("mlp", tensor),
        ("heads", tensor),
        ("kv_heads", tensor),
        ("vocab", tensor),
        ("layers", "stage"),
    ]
    if sequence:
        wanted.append(("length", tensor))
    rules = [(n, a) for n, a in wanted if a is not None and a in names]
    # names a transformer uses that these rules leave whole on purpose: activations' sequence length,
    # the per-head feature dimension, norms' scales
    kept_whole = {"length", "kv", "head_dim", "norm"}
    return Rules(rules, strict=strict, generic={n for n, _ in wanted} | kept_whole)


#: Named rule sets (`named_rules`): ``standard`` is `standard_rules`, ``sequence`` the same with sequence
#: parallelism (``standard_rules(..., sequence=True)``).
RULE_SETS = ("standard", "sequence")


def named_rules(name: str, axis_names: Iterable[str], *, strict: bool = False) -> Rules:
    """The rule set ``name`` (one of `RULE_SETS`) for a mesh with ``axis_names``."""
    if name not in RULE_SETS:
        raise ValueError(f"rule set {name!r} is not one of {list(RULE_SETS)}")
    return standard_rules(axis_names, strict=strict, sequence=name == "sequence")
