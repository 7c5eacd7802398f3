"""The SPMD step: one `jax.jit` on one mesh, and what it shares with the MPMD one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ..core.keyword_hints import keyword_hints
from ..core.layout import Layout
from ..core.meshes import mesh_context
from ..core.mirror import MirrorIndex
from ..core.placement import Placement, use_placement
from ..core.report import ShardingReport
from ..core.rules import Rules
from ..core.treecheck import check_same_structure, static_difference
from ..plan.partition import Plan
from ..trace.step_context import step_context_note
from .checks import (
    StepInputError,
    check_outputs,
    check_shapes,
    explain_call_error,
    place_batch,
)
from .runtime import RunStats

__all__ = ["Parallelized", "ShardedFunction", "place_batch"]


class Parallelized:
    """What every function built by `parallelize` offers: shardings, layouts, a report."""

    def __init__(self, fun: Callable, params: Layout, batch: Layout, abstract_params: Any, abstract_batch: Any):
        self.fun = fun
        self.param_layout = params
        self.batch_layout = batch
        self._abstract_params = abstract_params
        self._abstract_batch = abstract_batch
        self._param_treedef = jax.tree.structure(abstract_params)
        self._batch_treedef = jax.tree.structure(abstract_batch)
        self._mirror = MirrorIndex(abstract_params, params.shardings)

    @property
    def param_shardings(self) -> Any:
        return self.param_layout.shardings

    @property
    def batch_shardings(self) -> Any:
        return self.batch_layout.shardings

    @property
    def abstract_params(self) -> Any:
        """The parameters as `jax.ShapeDtypeStruct`s carrying their shardings: a restore target."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self._abstract_params, self.param_shardings)

    def _check_inputs(self, params: Any, batch: Any, treedefs: tuple[Any, Any] | None = None) -> Any:
        """Raise on a tree that differs from the one built for; return the placed batch.

        Trees whose only difference is static data (a `TrainState` made again
        with a new optimizer object) go to `_new_static`. ``treedefs``: the
        structures of ``params`` and ``batch``, when the caller has them.
        """
        p_def, b_def = treedefs or (jax.tree.structure(params), jax.tree.structure(batch))
        for tree, built, given, expected, what in (
                (params, self._abstract_params, p_def, self._param_treedef, "params"),
                (batch, self._abstract_batch, b_def, self._batch_treedef, "batch")):
            if given != expected:
                where = static_difference(built, tree, what)
                if where is None:
                    check_same_structure(built, tree, what)
                self._new_static(where)
        shardings = self.batch_shardings
        if b_def != self._batch_treedef:
            shardings = jax.tree.unflatten(b_def, jax.tree.leaves(shardings))
        return place_batch(batch, shardings, self._abstract_batch, self.fun)

    def _new_static(self, where: str | None) -> None:
        """Inputs with other static data than the step was traced with (``where``: the difference, when
        `static_difference` finds it): a step that cannot trace again refuses."""
        name = getattr(self.fun, "__name__", "fun")
        raise StepInputError(
            f"step {name!r}: {where}. Its plan was traced with the old object, and a pipelined "
            f"step is not traced again: pass the state that the sharded initializer (or the step) returned, "
            f"which carries the step's own objects, or call parallelize again for the new ones")

    def _call_error(self, e: Exception, params: Any, batch: Any, param_shardings: Any | None,
                    donate: bool) -> Exception | None:
        """A clear error for a failed call (donated buffers, shapes, layouts), or None."""
        return explain_call_error(e, self.fun, params=params, batch=batch, abstract_params=self._abstract_params,
                                  abstract_batch=self._abstract_batch, param_shardings=param_shardings,
                                  donate=donate)

    @keyword_hints
    def estimate(self, profile: Any = None, *, args: tuple = (), dtype: str | None = None,
                 model_flops: float | None = None, optimizer_paths: str | None = None) -> Any:
        """Memory per device, work and (with a hardware ``profile``: a `HardwareProfile` or a name of
        `multimesh.estimate.PROFILES`) predicted step time, without running the step: the options are
        `multimesh.estimate.estimate`'s (``optimizer_paths`` None: its default), see ``docs/planning.md``."""
        from ..estimate import estimate  # the estimate layer sits above this one: imported when asked

        return estimate(self, profile, args=args, dtype=dtype, model_flops=model_flops,
                        **({} if optimizer_paths is None else {"optimizer_paths": optimizer_paths}))

    def report(self, *, batch: bool = False) -> ShardingReport:
        """Where each parameter (``batch=True``: each batch array) lives, built without running anything.

        Print it for a table: per array its path, shape, dtype, logical names,
        `PartitionSpec`, mesh, (an MPMD step) the stage it lives on by name and
        device ids, and bytes per device, then the total, the most any one
        device holds and (MPMD) the bytes on each stage. Its ``warnings`` name
        logical names without a rule, rules that match nothing, and large
        arrays left replicated although a mesh axis divides them.
        ``bytes_per_device()`` gives the memory per device,
        ``bytes_per_stage()`` that per stage. See ``docs/sharding-report.md``.
        """
        layout = self.batch_layout if batch else self.param_layout
        return ShardingReport(layout.leaves, title=f"{'batch' if batch else 'parameters'} of {self!r}",
                              notes=layout.advice, stages=self.stages())

    def stages(self) -> dict[frozenset[int], str]:
        """The stages of an MPMD step, device ids -> name (``{}`` for a step on one mesh): what the
        report's ``stage`` column names."""
        plan = getattr(self, "plan", None)
        placements = plan.placements if plan is not None else []
        if len(placements) < 2:
            return {}
        return {frozenset(d.id for d in p.mesh.devices.flat): p.name or f"submesh{i}"
                for i, p in enumerate(placements)}


class ShardedFunction(Parallelized):
    """The sharded step built by `parallelize` (SPMD: one `jax.jit` on one mesh).

    Its ``plan`` has one placement and one segment (None when ``fun`` takes
    more than the parameters and the batch, and was not traced ahead): it is
    compiled as one `jax.jit` of ``fun`` under that placement. Call it as
    ``fun(params, batch, *args)``. Attributes: ``placement``, ``mesh``,
    ``rules``, ``param_shardings``, ``batch_shardings`` (pytrees like the
    inputs), ``param_layout``/``batch_layout`` (a record per array), `report`.
    """

    def __init__(self, fun: Callable, placement: Placement, params: Layout, batch: Layout, abstract_params: Any,
                 abstract_batch: Any, donate: bool, plan: Plan | None = None):
        super().__init__(fun, params, batch, abstract_params, abstract_batch)
        self.placement = placement
        self.plan = plan

        self._donate = donate
        self._jitted: dict[tuple, Any] = {}
        self._stats = RunStats()

    def _step_for(self, param_treedef: Any) -> Callable:
        """``fun`` as jit traces it, for parameters of this tree structure (new static data: traced again)."""
        fun, placement = self.fun, self.placement
        built = jax.tree.unflatten(param_treedef, jax.tree.leaves(self._abstract_params))
        mirror = self._mirror if param_treedef == self._param_treedef else \
            MirrorIndex(built, jax.tree.unflatten(param_treedef, jax.tree.leaves(self.param_shardings)))

        def step(p, b, *args):  # runs when jit traces: a new signature
            check_shapes(built, p, "params", fun)
            with use_placement(placement):
                out = fun(p, b, *args)
            check_outputs(out, fun)
            return mirror.constrain(out)

        step.__name__ = getattr(fun, "__name__", "step")
        setattr(step, "__wrapped__", fun)  # JAX's messages name the user's function (mypy: no attributes on functions)
        return step

    @property
    def mesh(self):
        return self.placement.mesh

    @property
    def stats(self) -> RunStats:
        """What the last call did, as an MPMD step's ``stats``: an SPMD step is one program on one mesh, so one
        execution, no copies between submeshes and no pipeline stages."""
        return self._stats

    @property
    def rules(self) -> Rules:
        return self.placement.rules

    def _jit(self, n_extra: int, p_def: Any, b_def: Any):
        """The jitted step for ``n_extra`` more arguments and parameters and batch of these tree structures."""
        key = (n_extra, p_def, b_def)
        if key not in self._jitted:
            shardings = (jax.tree.unflatten(p_def, jax.tree.leaves(self.param_shardings)),
                         jax.tree.unflatten(b_def, jax.tree.leaves(self.batch_shardings)))
            self._jitted[key] = jax.jit(self._step_for(p_def), in_shardings=shardings + (None,) * n_extra,
                                        donate_argnums=(0,) if self._donate else ())
        return self._jitted[key]

    def _new_static(self, where: str | None) -> None:
        """Like `jax.jit`, a step called with new static data (an optimizer made again) is traced again."""

    def __call__(self, params: Any, batch: Any, *args: Any) -> Any:
        treedefs = (jax.tree.structure(params), jax.tree.structure(batch))
        placed = self._check_inputs(params, batch, treedefs)
        try:
            with mesh_context(self.placement.mesh):  # its axis types, not a mesh the caller may have set
                out = self._jit(len(args), *treedefs)(params, placed, *args)
            self._stats = RunStats(executions=1, executed=[getattr(self.fun, "__name__", "step")])
            return out
        except (ValueError, TypeError, RuntimeError) as e:
            if isinstance(e, StepInputError):
                raise
            clear = self._call_error(e, params, batch, self.param_shardings, self._donate)
            if clear is None:
                raise
            raise clear from e

    def lower(self, params: Any, batch: Any, *args: Any):
        return self._jit(len(args), jax.tree.structure(params), jax.tree.structure(batch)).lower(params, batch, *args)

    def trace(self, params: Any, batch: Any, *args: Any):
        """The step traced for these (abstract) arguments: a `jax.stages.Traced` (``.jaxpr``, ``.lower()``)."""
        return self._jit(len(args), jax.tree.structure(params), jax.tree.structure(batch)).trace(params, batch, *args)

    def __repr__(self) -> str:
        name = getattr(self.fun, "__name__", "fun")
        return (f"ShardedFunction({name}, mesh={dict(self.mesh.shape)}, {len(self.param_layout.leaves)} params"
                f"{step_context_note(self.fun)})")


