"""Where one step of an MPMD pipeline spends this process's time (used by multiprocess_pipeline.py --profile).

`StepProfile` wraps a built `MPMDFunction`'s runtime for one call: it times
every action's program and every transfer, waiting for each result
(`jax.block_until_ready`) before the runtime goes on, so that each wait is
charged to what caused it:

- ``compute F/B/W``: a stage's forward, input-gradient and weight-gradient
  programs that run on this process; ``compute other``: the rest (the
  optimizer update, the glue between stages);
- ``receive``: transfers into this process, until the value has arrived: the
  time spent waiting for the other process (its compute, then the copy);
- ``send``: the calls that hand a value of this process to another;
- ``place inputs`` and ``deliver outputs``: moving the step's inputs onto their
  stages and its small outputs (the loss) to every process;
- ``runtime``: the rest of the step's wall time, the runtime's own Python
  (and the calls for programs that run on the other process only).

Waiting after each action serialises what JAX would overlap (a process's next
dispatch with its running program): the profiled step is a little slower than
the unprofiled one, which is reported beside it. The runtime is restored after
the call; nothing in multimesh changes.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["StepProfile", "profile_step"]

CATEGORIES = ("compute F", "compute B", "compute W", "compute other", "receive", "send", "place inputs",
              "deliver outputs", "runtime")


def _has_local_shards(x: Any) -> bool:
    return isinstance(x, jax.Array) and bool(x.addressable_shards)


def _wait(tree: Any) -> Any:
    """``tree`` once every array of it with shards on this process is computed (placeholders skipped)."""
    jax.block_until_ready([x for x in jax.tree.leaves(tree) if _has_local_shards(x)])
    return tree


class StepProfile:
    """Seconds per category (`CATEGORIES`) of one call of ``fn``, and per action of this process."""

    def __init__(self, fn: Any):
        self.fn = fn
        self.seconds: dict[str, float] = defaultdict(float)
        self.actions: list[tuple[str, float]] = []  # (label, seconds) of this process's programs, in order
        self.counts: dict[str, int] = defaultdict(int)
        self.wall = 0.0

    def _timed_program(self, step: Any) -> Callable:
        program, action = step.fn, step.segment.action
        category = f"compute {action.kind}" if action is not None else "compute other"

        def run(*args: Any) -> Any:
            if not step.local:  # a placeholder call: the other process computes; charged to the runtime
                return program(*args)
            start = time.perf_counter()
            outs = _wait(program(*args))
            elapsed = time.perf_counter() - start
            self.seconds[category] += elapsed
            self.counts[category] += 1
            self.actions.append((step.label, elapsed))
            return outs

        return run

    def _timed_copy(self, copy: Callable) -> Callable:
        def run(step: Any, held: dict) -> None:
            sources = [held[src] for _, src, _ in step.copies]
            start = time.perf_counter()
            copy(step, held)
            received = [held[dst] for _, _, dst in step.copies if _has_local_shards(held[dst])]
            _wait(received)
            category = "receive" if received else "send" if any(map(_has_local_shards, sources)) else "runtime"
            if category != "runtime":
                self.seconds[category] += time.perf_counter() - start
                self.counts[category] += 1

        return run

    def _timed(self, call: Callable, category: str) -> Callable:
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            out = _wait(call(*args))
            self.seconds[category] += time.perf_counter() - start
            self.counts[category] += 1
            return out

        return run

    def __call__(self, *args: Any) -> Any:
        """One call of ``fn`` (its result), profiled."""
        runtime, fn = self.fn.runtime, self.fn
        programs = [step.fn for step in runtime.steps]
        for step in runtime.steps:
            step.fn = self._timed_program(step)
        # instance attributes shadow the methods the runtime and the step call through ``self``
        runtime._copy = self._timed_copy(runtime._copy)
        runtime._place_input = self._timed(runtime._place_input, "place inputs")
        fn._deliver = self._timed(fn._deliver, "deliver outputs")
        try:
            start = time.perf_counter()
            out = _wait(fn(*args))
            self.wall = time.perf_counter() - start
        finally:
            for step, program in zip(runtime.steps, programs):
                step.fn = program
            for name in ("_copy", "_place_input"):
                del runtime.__dict__[name]
            del fn.__dict__["_deliver"]
        self.seconds["runtime"] = self.wall - sum(v for k, v in self.seconds.items() if k != "runtime")
        return out

    def summary(self) -> dict:
        """JSON-ready: the wall time, seconds and counts per category, the programs of this process in order."""
        return {"wall": self.wall, "seconds": {k: self.seconds.get(k, 0.0) for k in CATEGORIES},
                "counts": {k: self.counts.get(k, 0) for k in CATEGORIES}, "actions": self.actions}


def profile_step(fn: Any, *args: Any) -> tuple[Any, dict]:
    """``fn(*args)`` profiled: its result and `StepProfile.summary`."""
    profile = StepProfile(fn)
    out = profile(*args)
    return out, profile.summary()
