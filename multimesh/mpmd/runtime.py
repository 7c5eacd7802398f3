"""Run an MPMD plan: one `jax.jit` per segment, values resharded between submeshes.

The runtime walks the segments in plan order. Before a segment runs, each of
its inputs that lives on another submesh is moved with `jax.device_put` (same
`PartitionSpec` when the destination mesh can hold it, else replicated there).
Values are dropped after their last use. JAX dispatches asynchronously, so
different submeshes work at once; every `sync_every` executions the runtime
waits for the latest result, bounding the work in flight (XLA:CPU aborts when
too many executions with collectives are queued).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend.core import Literal, Var, jaxpr_as_fun
from jax.sharding import NamedSharding

from .plan import Plan, Segment
from .transfer import reshard_to

__all__ = ["Runtime", "RunStats"]


@dataclass
class RunStats:
    """What the last run did: executions, transfers, bytes moved."""

    executions: int = 0
    transfers: int = 0
    bytes_moved: int = 0


class Runtime:
    """Compiles each segment of a plan and executes the plan."""

    def __init__(self, plan: Plan, input_shardings: dict[Var, NamedSharding], *, sync_every: int = 16):
        self.plan = plan
        self.input_shardings = input_shardings
        self.sync_every = sync_every
        self.stats = RunStats()
        self._fns = [jax.jit(jaxpr_as_fun(seg.closed_jaxpr())) for seg in plan.segments]
        last_use: dict[Var, int] = {}
        for seg in plan.segments:
            for v in seg.invars:
                last_use[v] = seg.index
        outputs = {v for v in plan.jaxpr.outvars if not isinstance(v, Literal)}
        self._free_after = {i: [v for v, k in last_use.items() if k == i and v not in outputs] for i in range(len(plan.segments))}

    def _gather(self, seg: Segment, env: dict[Var, Any]) -> list:
        args = []
        for v in seg.invars:
            x = env[v]
            if not isinstance(x, jax.Array) or not x.sharding.device_set <= seg.placement.devices:
                target = self.input_shardings.get(v) if v not in self.plan.producer else None
                if target is not None and target.device_set <= seg.placement.devices:
                    x = jax.device_put(x, target)
                else:
                    x = reshard_to(x, seg.placement.mesh)
                self.stats.transfers += 1
                self.stats.bytes_moved += x.nbytes
                env[v] = x
            args.append(x)
        return args

    def __call__(self, flat_inputs: Sequence[Any]) -> list:
        plan = self.plan
        env: dict[Var, Any] = dict(zip(plan.jaxpr.invars, flat_inputs))
        env.update(plan.consts)
        self.stats = RunStats()
        last = None
        for seg, fn in zip(plan.segments, self._fns):
            outs = fn(*self._gather(seg, env))
            env.update(zip(seg.outvars, outs))
            self.stats.executions += 1
            for v in self._free_after[seg.index]:
                env.pop(v, None)
            if outs:
                last = outs[0]
            if self.sync_every and self.stats.executions % self.sync_every == 0 and last is not None:
                jax.block_until_ready(last)
        return [v.val if isinstance(v, Literal) else env[v] for v in plan.jaxpr.outvars]
