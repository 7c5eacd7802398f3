"""Is an order a schedule? Every action once, within the pipeline's shape, after what it depends on."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .actions import FORWARD, WEIGHT, Action, PipelineShape

__all__ = ["check_action", "check_complete", "check_order", "check_per_stage"]


def check_action(shape: PipelineShape, a: object) -> Action:
    """``a`` if it is an action this pipeline can run, else a ValueError saying why."""
    if not isinstance(a, Action):
        raise ValueError(f"expected Action, got {a!r}")
    if a.stage >= shape.num_logical_stages:
        raise ValueError(f"{a}: stage {a.stage} out of range for {shape.num_logical_stages} logical stages")
    if a.microbatch >= shape.num_microbatches:
        raise ValueError(f"{a}: microbatch {a.microbatch} out of range for {shape.num_microbatches} microbatches")
    if a.chunk != a.stage // shape.num_stages:
        raise ValueError(f"{a}: chunk {a.chunk} inconsistent with logical stage {a.stage} "
                         f"(expected chunk {a.stage // shape.num_stages} with {shape.num_stages} stages)")
    if shape.forward_only and a.kind != FORWARD:
        raise ValueError(f"{a}: backward action in a forward-only schedule")
    if a.kind == WEIGHT and not shape.split_backward:
        raise ValueError(f"{a}: weight-gradient (W) action in a schedule without a split backward "
                         f"(split_backward=False, where B is the whole backward); W actions need "
                         f"split_backward=True")
    return a


def check_per_stage(shape: PipelineShape, per_stage: Mapping[int, Sequence[object]]) -> dict[int, tuple[Action, ...]]:
    """Each physical stage's actions (every stage present, in its own order), checked to belong there."""
    extra = sorted(set(per_stage) - set(range(shape.num_stages)))
    if extra:
        raise ValueError(f"per-stage order has stages {extra} outside 0..{shape.num_stages - 1}")
    out: dict[int, tuple[Action, ...]] = {}
    for s in range(shape.num_stages):
        for a in per_stage.get(s, ()):
            if not isinstance(a, Action):
                raise ValueError(f"stage {s}: expected Action, got {a!r}")
            check_action(shape, a)
            if shape.physical_stage(a) != s:
                raise ValueError(f"{a} belongs to physical stage {shape.physical_stage(a)} but is listed for stage {s}")
        out[s] = tuple(per_stage.get(s, ()))  # type: ignore[arg-type]  # each checked an Action just above
    return out


def check_complete(shape: PipelineShape, actions: Iterable[Action]) -> None:
    """Every action the shape expects, each exactly once."""
    seen: dict[Action, int] = {}
    for a in actions:
        seen[a] = seen.get(a, 0) + 1
    dup = [str(a) for a, n in seen.items() if n > 1]
    if dup:
        raise ValueError(f"actions scheduled more than once: {', '.join(dup[:10])}")
    missing = [a for a in shape.expected_actions() if a not in seen]
    if missing:
        more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
        why = ("; a split-backward schedule (split_backward=True, e.g. one with W actions) needs a W after every B"
               if any(a.kind == WEIGHT for a in missing) else "")
        raise ValueError(f"actions missing from schedule: {', '.join(map(str, missing[:10]))}{more}{why}")


def check_order(shape: PipelineShape, order: Sequence[Action], per_stage: Mapping[int, Sequence[Action]],
                name: str) -> None:
    """Completeness, every action after its dependencies in ``order``, and each stage's order the
    projection of ``order`` onto that stage; a ValueError naming schedule ``name`` otherwise."""
    check_complete(shape, order)
    pos = {a: i for i, a in enumerate(order)}
    for i, a in enumerate(order):
        for d in shape.dependencies(a):
            if pos[d] > i:
                raise ValueError(f"invalid {name} schedule: {a} at position {i} runs before "
                                 f"its dependency {d} at position {pos[d]}")
    for s, acts in per_stage.items():
        if tuple(a for a in order if shape.physical_stage(a) == s) != tuple(acts):
            raise ValueError(f"invalid {name} schedule: stage {s}'s order disagrees with the global order")
