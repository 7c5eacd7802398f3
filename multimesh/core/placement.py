"""The placement in scope while a function is traced: a mesh and its rules.

`task` and `parallelize` push a `Scope`; `with_sharding_constraint` and
`shard_map` read it to resolve logical names. Kept in a `ContextVar`, so
threads (and Orbax's background threads) do not see each other's scopes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .rules import LogicalSpec, Rules, check_physical

__all__ = ["Scope", "current_scope", "use_scope"]


@dataclass(frozen=True)
class Scope:
    """A mesh, the rules that resolve logical names on it, and who set them.

    The effective rules are the user's, followed by an identity rule for each
    mesh axis that the user's rules do not name as a logical name: a spec may
    always name a mesh axis directly.
    """

    mesh: Mesh
    rules: Rules = field(default_factory=Rules)
    name: str | None = None
    #: Logical constraints traced under this scope are kept (`deferred.logical_constraint_p`) and
    #: resolved where the equation finally runs: `parallelize` traces a step so, before it knows
    #: which submesh each piece runs on. A task's own scope resolves at once.
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

    def spec(self, logical: LogicalSpec | None, shape: Sequence[int] | None = None, *, path: str | None = None) -> PartitionSpec:
        """Resolve a logical spec (tuple or `PartitionSpec` of logical names)."""
        return self.rules.resolve(logical, self.axis_sizes, shape, path=path)

    def sharding(self, logical: LogicalSpec | None, shape: Sequence[int] | None = None, *, path: str | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape, path=path))

    def physical(self, spec: PartitionSpec, shape: Sequence[int] | None = None, *, path: str | None = None) -> NamedSharding:
        """A `PartitionSpec` of mesh axes, validated against this mesh."""
        return NamedSharding(self.mesh, check_physical(spec, self.axis_sizes, shape, path=path))

    def deferring(self) -> Scope:
        """This scope with logical constraints deferred (see ``defer``)."""
        return dataclasses.replace(self, defer=True)

    def __repr__(self) -> str:
        who = f"{self.name!r}, " if self.name else ""
        return f"Scope({who}mesh={dict(self.mesh.shape)}, rules={self.rules!r})"


_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("multimesh_scope", default=None)


def current_scope() -> Scope | None:
    return _SCOPE.get()


@contextlib.contextmanager
def use_scope(scope: Scope | None) -> Iterator[Scope | None]:
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)

