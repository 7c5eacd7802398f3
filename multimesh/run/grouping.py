"""A stage's consecutive actions of one program as one host call: fewer round trips per microbatch.

A pipeline calls a stage's forward (backward) program once per microbatch.
Where a stage runs several of them back to back (GPipe's forwards, a run of
backward passes), `group_order` gathers them, at most ``max_size`` at a time,
into one group that the runtime dispatches as one `jax.jit` calling the
stage's program once per member (`grouped_program`): one host call and one
round of bookkeeping for the group instead of one per action. Each member
runs the same program as alone, inlined (``tests/test_grouped_actions.py``
finds outputs, gradients and optimizer states bit-equal).

Only the global order changes, never a stage's own: a later action of the
stage joins the group when every action between them runs on other submeshes
and none of those produces one of its inputs; those actions then run after
the group. So each stage runs its actions in the schedule's order and holds
the same activations at once. On XLA:CPU a multi-device execution returns
when its devices are done, so stages do not overlap anyway and a group only
saves host work; where dispatch is asynchronous (GPU, TPU) a group's first
result reaches the next stage only when the whole group is done, which lengthens
the pipeline's fill by the group's other members.

``MULTIMESH_GROUP_ACTIONS`` (or ``Runtime(group_actions=...)``) bounds the
group size; unset or 1, each action is its own call (the default: a group
changes the global order that `RunStats.executed` reports, and on an
accelerator it delays the next stage). `SUGGESTED_GROUP_SIZE` is a bound
that pays on CPU for GPipe-like runs (``benchmarks/pipeline_host_loop.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Var

from ..plan.segment import Segment

__all__ = ["GROUP_ACTIONS_VARIABLE", "SUGGESTED_GROUP_SIZE", "default_group_size", "group_order",
           "grouped_program"]

#: The environment variable bounding how many actions one host call runs (unset or 1: one each).
GROUP_ACTIONS_VARIABLE = "MULTIMESH_GROUP_ACTIONS"

#: A bound worth setting on CPU (compile time grows with it: each group shape is one more executable).
SUGGESTED_GROUP_SIZE = 8


def default_group_size() -> int:
    """The group size bound: ``MULTIMESH_GROUP_ACTIONS`` if set, else 1 (each action alone)."""
    value = os.environ.get(GROUP_ACTIONS_VARIABLE)
    if value is None or not value.strip():
        return 1
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"{GROUP_ACTIONS_VARIABLE}={value!r}: the most actions one host call runs must be a "
                         f"positive int (1 runs each action alone, {SUGGESTED_GROUP_SIZE} suits CPU); unset it "
                         f"for the default (1)")
    return size


def group_order(segments: Sequence[Segment], producer: dict[Var, int], program_of: Sequence[int],
                groupable: Sequence[bool], max_size: int) -> list[list[int]]:
    """The segments' indices in execution order, in groups of one program on one submesh (module docstring).

    ``program_of[k]``: segment ``k``'s program; ``groupable[k]``: whether it may share a call (an action
    whose program donates nothing); ``producer``: the segment computing each value.
    """
    done = [False] * len(segments)
    groups: list[list[int]] = []
    for i, seg in enumerate(segments):
        if done[i]:
            continue
        done[i] = True
        group = [i]
        if max_size > 1 and groupable[i]:
            here, passed = seg.placement.devices, set()
            for j in range(i + 1, len(segments)):
                if len(group) == max_size:
                    break
                if done[j]:
                    continue
                other = segments[j]
                if other.placement.devices != here:
                    passed.add(j)  # runs after the group
                    continue
                if (program_of[j] != program_of[i] or not groupable[j]
                        or any(producer.get(v) in passed for v in other.invars)):
                    break  # the stage's next action is not a member: its order is kept
                group.append(j)
                done[j] = True
        groups.append(group)
    return groups


Source = tuple[int, int]  # (-1, argument) for the group's own argument, else (member, output of that member)


def grouped_program(calls: Sequence[tuple[Callable, Sequence[Source]]], exported: Sequence[Source],
                    name: str) -> Callable:
    """One `jax.jit` calling each member's program on its arguments, in order, and returning ``exported``.

    ``calls``: per member, its (jitted) program and where each of its arguments comes from: the group's
    arguments or an earlier member's output (a gradient sum one backward passes to the next).
    """

    def group(*args: Any) -> list:
        outs: list[Sequence[Any]] = []
        for fn, sources in calls:
            outs.append(fn(*[args[i] if m < 0 else outs[m][i] for m, i in sources]))
        return [outs[m][i] for m, i in exported]

    group.__name__ = name
    return jax.jit(group)
