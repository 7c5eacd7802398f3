"""Where a computation runs: a mesh, the rules that resolve logical names on it, a name.

A `Placement` is what `parallelize` builds from its mesh and rules, what
each task runs on, and what a plan's segment is compiled for. While a
function is traced, the placement in force (`use_placement`) is what
`with_sharding_constraint` and `shard_map` read to resolve logical names.
Kept in a `ContextVar`, so threads (and Orbax's background threads) do not
see each other's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .fmt import device_span
from .meshes import mesh_context
from .rules import LogicalSpec, RuleError, Rules, check_physical

__all__ = ["Placement", "current_placement", "use_placement", "while_placed"]


@dataclass(frozen=True)
class Placement:
    """A mesh, the rules that resolve logical names on it, and its name (a task's, say).

    The effective rules are the user's, followed by an identity rule for each
    mesh axis that the user's rules do not name as a logical name: a spec may
    always name a mesh axis directly. Hashable: a task's placement is a
    parameter of its primitive.
    """

    mesh: Mesh
    rules: Rules = field(default_factory=Rules)
    name: str | None = None
    #: Logical constraints traced under this placement are kept (`deferred.logical_constraint_p`)
    #: and resolved where the equation finally runs: `parallelize` traces a step so, before it
    #: knows which submesh each piece runs on. A task's own placement resolves at once.
    defer: bool = False

    def __post_init__(self):
        rules = Rules(self.rules)
        rules.check_mesh(self.axis_sizes)
        taken = rules.logical_names
        fallback = [(a, a) for a in self.mesh.axis_names if a not in taken]
        object.__setattr__(self, "rules", rules + fallback)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    def spec(self, logical: LogicalSpec | None, shape: Sequence[int] | None = None, *,
             path: str | None = None) -> PartitionSpec:
        """Resolve a logical spec (tuple or `PartitionSpec` of logical names)."""
        return self.rules.resolve(logical, self.axis_sizes, shape, path=path)

    def sharding(self, logical: LogicalSpec | None, shape: Sequence[int] | None = None, *,
                 path: str | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape, path=path))

    def physical(self, spec: PartitionSpec, shape: Sequence[int] | None = None, *, path: str | None = None,
                 logical_fallback: bool = True) -> NamedSharding:
        """A `PartitionSpec` of mesh axes, validated against this mesh.

        As in MultiMesh, every annotation name is logical at heart: when the
        spec names something that is not an axis of this mesh but is a logical
        name of the rules (``nn.with_partitioning(init, ("data", "model"))``
        in a task whose rules map ``data``/``model`` to its axes), the whole
        spec is resolved by the rules. A name neither a mesh axis nor covered
        by a rule stays an error. ``logical_fallback=False``: mesh axes only
        (a `PartitionSpec` in ``param_rules`` says it holds mesh axes).
        """
        names = {a for entry in spec if entry is not None and entry is not PartitionSpec.UNCONSTRAINED
                 for a in ((entry,) if isinstance(entry, str) else tuple(entry))}
        foreign = names - set(self.axis_sizes)
        if logical_fallback and foreign:
            uncovered = [a for entry in spec if entry is not None and entry is not PartitionSpec.UNCONSTRAINED
                         for a in ((entry,) if isinstance(entry, str) else tuple(entry))
                         if a in foreign and a not in self.rules.logical_names]
            if not uncovered:
                return NamedSharding(self.mesh, self.spec(tuple(spec), shape, path=path))
            a = uncovered[0]
            where = f" of the array of {path!r}" if path else ""
            raise RuleError(f"PartitionSpec {spec}{where} names mesh axis {a!r}, but the mesh has axes "
                            f"{self.axis_sizes} and no rule maps {a!r} as a logical name; name a mesh axis, "
                            f"or add a rule ({a!r}, <mesh axis>) (a task's logical_axes=)")
        return NamedSharding(self.mesh, check_physical(spec, self.axis_sizes, shape, path=path))

    @functools.cached_property
    def own_rules(self) -> Rules:
        """The rules less the identity rule of each mesh axis (which every placement has): what was given."""
        axes = set(self.mesh.axis_names)
        return Rules([(n, a) for n, a in self.rules if not (n == a and n in axes)], strict=self.rules.strict,
                     generic=self.rules.generic)

    def __hash__(self) -> int:
        # hashed once: a plan keys thousands of equations (64 microbatches: some 75,000) by placement
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.mesh, self.rules, self.name, self.defer))
            object.__setattr__(self, "_hash", cached)
        return cached

    @functools.cached_property
    def devices(self) -> frozenset:
        return frozenset(self.mesh.devices.flat)

    def describe(self) -> str:
        """``name on {axis: size} devices [ids]``."""
        span = device_span(sorted(d.id for d in self.mesh.devices.flat))
        where = f"{dict(self.mesh.shape)} devices [{span}]"
        return f"{self.name} on {where}" if self.name else where

    def deferring(self) -> Placement:
        """This placement with logical constraints deferred (see ``defer``)."""
        return dataclasses.replace(self, defer=True)

    def __repr__(self) -> str:
        return f"Placement({self.describe()}, rules={self.rules!r})"


_PLACEMENT: contextvars.ContextVar[Placement | None] = contextvars.ContextVar("multimesh_placement", default=None)


def current_placement() -> Placement | None:
    return _PLACEMENT.get()


_WHILE_PLACED: list[Callable[[], contextlib.AbstractContextManager]] = []


def while_placed(hook: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Enter ``hook()`` whenever a placement is put in force: what the layers above need while user
    code is traced under one (`trace.linen_constraints` routes Flax Linen's logical constraints)."""
    if hook not in _WHILE_PLACED:
        _WHILE_PLACED.append(hook)


@contextlib.contextmanager
def use_placement(placement: Placement | None) -> Iterator[Placement | None]:
    """``placement`` in force while tracing, its mesh JAX's mesh in context (explicit-sharding code resolves
    its specs there), and Flax NNX's eager sharding off: shardings are ours to apply."""
    token = _PLACEMENT.set(placement)
    try:
        with nnx.use_eager_sharding(False), mesh_context(placement.mesh if placement is not None else None), \
                contextlib.ExitStack() as hooks:
            if placement is not None:
                for hook in _WHILE_PLACED:
                    hooks.enter_context(hook())
            yield placement
    finally:
        _PLACEMENT.reset(token)

