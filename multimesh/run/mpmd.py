"""The MPMD step built by `parallelize` when the function calls tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.tree_util import PyTreeDef

from ..core.layout import Layout
from ..core.meshes import no_mesh_context
from ..core.processes import is_failed_exchange, lost_process_error
from ..core.transfer import everywhere, move
from ..plan.partition import Plan
from ..trace.step_context import step_context_note
from .checks import StepInputError, check_shapes
from .runtime import Runtime
from .spmd import Parallelized
from .stacked import from_parts, part_shardings, to_parts

__all__ = ["READABLE_BYTES", "MPMDFunction", "state_scalars"]

#: With several processes, outputs that are not parameters (the loss, metrics) up to this size are copied
#: to every process, so ``float(loss)`` works everywhere; larger ones stay on the stage that made them.
READABLE_BYTES = 1 << 20


def state_scalars(abstract_params: Any) -> list[int]:
    """The positions of the state's scalars among its leaves (an optimizer's count, a metric's total, an
    ``nnx.Rngs`` key): a pipeline keeps them together on its last stage (`run.parallelize`)."""
    return [i for i, a in enumerate(jax.tree.leaves(abstract_params)) if not np.shape(a)]


def _free_unread_scalars(scalars: list, outs: list) -> None:
    """Donated state the step only copied elsewhere, freed as donation promises: a scalar of the state lives on
    the last stage (`state_scalars`), and where only other stages read it no program there
    was given its buffer."""
    kept = {id(x) for x in outs}
    for x in scalars:
        if isinstance(x, jax.Array) and id(x) not in kept and not x.is_deleted():
            x.delete()


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
        self._shardings = flat_shardings
        if plan.boundary is not None:  # a split scanned stack: the plan takes its arrays in per-stage parts
            flat_shardings = part_shardings(plan.boundary.inputs, flat_shardings)
            n_params = plan.boundary.plan_index(n_params)
        donated = set(plan.jaxpr.invars[:n_params]) if donate else set()
        self.runtime = Runtime(plan, dict(zip(plan.jaxpr.invars, flat_shardings)), donated=donated)
        self._donate = donate
        # the state's scalars, by position among the step's inputs: freed after each step (across processes
        # a transfer may still read one)
        self._donated_scalars = state_scalars(abstract_params) if donate and jax.process_count() == 1 else []
        self._shapes = tuple(tuple(a.shape) for a in jax.tree.leaves((abstract_params, abstract_batch)))
        self._out_tree = out_tree
        # One target per output leaf (None: not a parameter's mirror). Up to the outputs' own leaves: a
        # None inside them (an NNX module's unset attribute) is an empty node, not an output.
        # annotated with the public name: mypy sees no type behind jax's own alias (jaxlib has no stubs)
        out_tree_def: PyTreeDef = jax.tree.structure(out_abstract)
        self._out_targets = out_tree_def.flatten_up_to(self._mirror.shardings_for(out_abstract))

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
            boundary = self.plan.boundary
            with no_mesh_context():
                if boundary is None:
                    outs = self.runtime(flat)
                else:
                    outs = self.runtime(to_parts(flat, boundary.inputs, self._shardings))
                    outs = from_parts(outs, boundary.outputs, self._out_targets)
            outs = _deliver(outs, self._out_targets)
            if self._donated_scalars:
                _free_unread_scalars([flat[i] for i in self._donated_scalars], outs)
        except (ValueError, TypeError, RuntimeError) as e:
            if isinstance(e, StepInputError):
                raise
            if jax.process_count() > 1 and is_failed_exchange(e):  # did another process stop?
                raise lost_process_error(e, f"step {getattr(self.fun, '__name__', 'fun')!r}") from e
            clear = self._call_error(e, params, batch, None, self._donate)
            if clear is None:
                raise
            raise clear from e
        return jax.tree.unflatten(self._out_tree, outs)

    def __repr__(self) -> str:
        name = getattr(self.fun, "__name__", "fun")
        stages = ", ".join(str(p.name) for p in self.plan.placements)
        return (f"MPMDFunction({name}, {len(self.plan.segments)} segments in {len(self.runtime.programs)} programs "
                f"on [{stages}], {len(self.param_layout.leaves)} params{step_context_note(self.fun)})")


def _deliver(outs: list, targets: list[NamedSharding | None]) -> list:
    """The step's outputs where the caller expects them: a parameter in its own sharding; with several
    processes, a small other output (up to `READABLE_BYTES`) on every process. The moves are one call: most
    are a parameter relabelled (the program gives ``P('tensor')`` where the parameter has
    ``P('tensor', None)``), and one batched `jax.device_put` of them all costs about half of one per leaf."""
    moving, dests = [], []
    several = jax.process_count() > 1
    for i, (x, target) in enumerate(zip(outs, targets)):
        if not isinstance(x, jax.Array):
            continue
        if target is None and several and x.nbytes <= READABLE_BYTES and not _readable_here_and_everywhere(x):
            target = everywhere(x)
        if target is not None and x.sharding != target:
            moving.append(i)
            dests.append(target)
    if not moving:
        return outs
    outs = list(outs)
    for i, y in zip(moving, move([outs[i] for i in moving], dests)):
        outs[i] = y
    return outs


def _readable_here_and_everywhere(x: jax.Array) -> bool:
    """Every process holds a whole copy of ``x`` already."""
    if not x.is_fully_replicated:
        return False
    devices: set[jax.Device] = x.sharding.device_set  # the public name: jaxlib has no stubs behind jax's alias
    return {d.process_index for d in devices} == set(range(jax.process_count()))
