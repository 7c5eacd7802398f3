"""The MPMD step built by `parallelize` when the function calls tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding

from ..core.layout import Layout
from ..plan.partition import Plan
from .checks import StepInputError, check_shapes
from .runtime import Runtime
from .spmd import Parallelized

__all__ = ["MPMDFunction"]


class MPMDFunction(Parallelized):
    """A step made of tasks: per-submesh executables run by a small runtime.

    ``plan`` (print it) shows the segments, their submeshes and the values
    resharded between them; ``stats`` what the last call did.
    """

    def __init__(self, fun: Callable, plan: Plan, params: Layout, batch: Layout, abstract_params: Any,
                 abstract_batch: Any, out_tree: Any, out_abstract: Any, donate: bool = False):
        super().__init__(fun, params, batch, abstract_params, abstract_batch)
        self.plan = plan
        flat_shardings = jax.tree.leaves(params.shardings) + jax.tree.leaves(batch.shardings)
        n_params = len(jax.tree.leaves(abstract_params))
        donated = set(plan.jaxpr.invars[:n_params]) if donate else set()
        self.runtime = Runtime(plan, dict(zip(plan.jaxpr.invars, flat_shardings)), donated=donated)
        self._donate = donate
        self._shapes = tuple(tuple(a.shape) for a in jax.tree.leaves((abstract_params, abstract_batch)))
        self._out_tree = out_tree
        targets = self._mirror.shardings_for(out_abstract)
        self._out_targets = jax.tree.leaves(
            jax.tree.map(lambda _, t: t, out_abstract, targets, is_leaf=lambda x: x is None),
            is_leaf=lambda x: x is None or isinstance(x, NamedSharding),
        )

    @property
    def stats(self):
        return self.runtime.stats

    def __call__(self, params: Any, batch: Any) -> Any:
        placed = self._check_inputs(params, batch)
        flat = jax.tree.leaves(params) + jax.tree.leaves(placed)
        if tuple(getattr(x, "shape", ()) for x in flat) != self._shapes:  # the plan is built for these shapes
            check_shapes(self._abstract_params, params, "params", self.fun)
            check_shapes(self._abstract_batch, placed, "batch", self.fun)
        try:
            outs = self.runtime(flat)
        except (ValueError, TypeError, RuntimeError) as e:
            if isinstance(e, StepInputError):
                raise
            clear = self._call_error(e, params, batch, None, self._donate)
            if clear is None:
                raise
            raise clear from e
        outs = [
            x if t is None or (isinstance(x, jax.Array) and x.sharding == t) else jax.device_put(x, t)
            for x, t in zip(outs, self._out_targets)
        ]
        return jax.tree.unflatten(self._out_tree, outs)

    def __repr__(self) -> str:
        name = getattr(self.fun, "__name__", "fun")
        stages = ", ".join(p.name for p in self.plan.placements)
        return (f"MPMDFunction({name}, {len(self.plan.segments)} segments in {len(self.runtime.programs)} programs "
                f"on [{stages}], {len(self.param_layout.leaves)} params)")

