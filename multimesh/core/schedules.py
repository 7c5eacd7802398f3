"""Pipeline schedules: the order in which microbatch forward/backward work runs.

A pipeline of ``S`` *stages* (device groups, i.e. task submeshes) processes ``M``
*microbatches*.  Each unit of work is an :class:`Action`: the forward (``"F"``)
or backward (``"B"``) pass of one microbatch on one stage, or, in a schedule
that splits the backward (zero-bubble schedules), its input-gradient
(``"B"``) and weight-gradient (``"W"``) halves.  A :class:`Schedule`
fixes, for every stage, the order in which that stage runs its actions, and
from it derives a global order (a valid topological order of the dependency
DAG), a simulated timeline, the bubble fraction and the peak number of live
microbatch activations per stage.  Everything here is pure Python; no JAX.

Worked example::

    >>> from multimesh.core.schedules import get_schedule
    >>> s = get_schedule("1f1b", num_stages=3, num_microbatches=4)
    >>> [str(a) for a in s.per_stage_order[2][:4]]   # last stage: F/B alternate
    ['F[s2,m0]', 'B[s2,m0]', 'F[s2,m1]', 'B[s2,m1]']
    >>> s.peak_live_activations         # min(S - s, M)
    {0: 3, 1: 2, 2: 1}
    >>> round(s.bubble_fraction, 4)     # (S-1)/(M+S-1) = 2/6
    0.3333
    >>> print(s.render())               # one slot per action
    stage 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
    stage 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
    stage 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .
    >>> s.order[:4] == [s.action(0, 0, "F"), s.action(0, 1, "F"), s.action(1, 0, "F"),
    ...                 s.action(0, 2, "F")]
    True

Zero bubble (ZB-H1): the backward is split into ``B`` (input gradient, which
the previous stage waits for) and ``W`` (weight gradient, which nobody waits
for); ``W`` passes fill what were bubbles, with 1F1B's activation memory::

    >>> z = get_schedule("zb-h1", num_stages=3, num_microbatches=4)
    >>> z.split_backward
    True
    >>> print(z.render())               # F, B and W one slot each
    stage 0 | F0 F1 F2 .  .  B0 W0 F3 B1 W1 .  B2 W2 .  B3 W3
    stage 1 | .  F0 F1 .  B0 W0 F2 B1 W1 F3 B2 W2 .  B3 W3 .
    stage 2 | .  .  F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3 .  .
    >>> z.peak_live_activations         # as 1F1B: min(S - s, M)
    {0: 3, 1: 2, 2: 1}
    >>> round(z.bubble_fraction, 4)     # 2(S-1)/(3M+2(S-1)) = 4/16, 1F1B: 6/18
    0.25

Conventions
-----------
* ``num_stages`` (``S``) is always the number of **physical** stages (device
  groups).  For non-interleaved schedules a stage is both logical and physical.
* Interleaved schedules split each device group's model part into
  ``num_chunks`` (``V``) *virtual stages*.  There are ``L = S * V`` logical
  stages; logical stage ``l`` is chunk ``l // S`` of device group ``l % S``, i.e.
  ``logical = chunk * S + group`` (Megatron layout: group ``g`` holds logical
  stages ``g, g + S, g + 2S, ...``).  :attr:`Action.stage` is the logical
  stage, :attr:`Action.chunk` its chunk, and :meth:`Schedule.physical_stage`
  the device group that runs it.
* Dependencies: ``F(l, m)`` after ``F(l-1, m)``; ``B(l, m)`` after ``F(l, m)``
  and after ``B(l+1, m)`` (the last logical stage's backward only needs its own
  forward); ``W(l, m)`` after ``B(l, m)``.
* Split backward (:attr:`Schedule.split_backward`, the zero-bubble schedules):
  ``B`` is then only the input-gradient pass (on the critical path: stage
  ``l-1`` waits for it) and ``W`` (weight gradient) the rest of the same
  (stage, microbatch)'s backward; every ``B`` has its ``W``.  Schedules without
  a split (GPipe, 1F1B, interleaved) have no ``W`` actions and ``B`` is the
  whole backward.  An explicit order (:meth:`Schedule.from_order`,
  :meth:`Schedule.from_per_stage_order`) is split iff it holds a ``W``
  action, unless ``split_backward=`` says otherwise.
* Time model (:meth:`Schedule.simulate`): a forward of a whole stage takes
  ``forward_time`` (default 1), a backward ``backward_time`` (default 2, the
  usual "backward costs twice the forward"); with ``V`` chunks each action costs
  ``1/V`` of that.  A stage runs its actions in its own order, each as soon as
  the stage is free and its dependencies have finished (plus ``comm_time`` when
  the dependency ran on another stage).  For GPipe and 1F1B the resulting
  bubble fraction equals ``(S-1)/(M+S-1)`` whatever the F/B cost ratio.  In a
  split schedule ``B`` and ``W`` each cost ``backward_time / 2`` (the whole
  backward still costs ``backward_time``); with the default costs
  (F = B = W = 1) ZB-H1's bubble is ``2(S-1)/(3M+2(S-1))`` and ZB-H2's
  ``(S-1)/(3M+S-1)`` for ``M >= S``.
* Live activations (:attr:`Schedule.peak_live_activations`): a microbatch's
  activations on a stage are live from its ``F`` until its backward has run:
  until ``B`` without a split, until ``W`` with one (``W`` still reads the
  stashed forward inputs).
* ``forward_only=True`` (inference) gives only ``F`` actions; then nothing is
  stashed for a backward pass and the peak live activations are 0.  There is
  no backward to split either: a forward-only schedule has
  ``split_backward=False`` (the zero-bubble schedules then equal 1F1B's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Literal

__all__ = [
    "KNOWN_SCHEDULES",
    "Action",
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "Schedule",
    "Timeline",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
    "get_schedule",
]

Kind = Literal["F", "B", "W"]
FORWARD: Kind = "F"
BACKWARD: Kind = "B"
WEIGHT: Kind = "W"


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work.

    Attributes:
      stage: logical pipeline stage (``chunk * num_stages + device_group``).
      microbatch: microbatch index, ``0 <= microbatch < num_microbatches``.
      kind: ``"F"`` (forward), ``"B"`` (backward; in a split-backward schedule
        only its input-gradient pass) or ``"W"`` (weight-gradient pass, split
        schedules only).
      chunk: virtual-stage index within the device group (0 unless
        interleaved); always ``stage // num_stages``.
    """

    stage: int
    microbatch: int
    kind: Kind
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in (FORWARD, BACKWARD, WEIGHT):
            raise ValueError(f"Action kind must be 'F', 'B' or 'W', got {self.kind!r}")
        for field in ("stage", "microbatch", "chunk"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"Action {field} must be a non-negative int, got {v!r}")

    @property
    def is_forward(self) -> bool:
        return self.kind == FORWARD

    @property
    def label(self) -> str:
        """Short cell label: ``F3``/``B3``/``W3`` (chunk 0) or ``F3.1`` (microbatch
        3, chunk 1)."""
        base = f"{self.kind}{self.microbatch}"
        return base if self.chunk == 0 else f"{base}.{self.chunk}"

    def __str__(self) -> str:
        extra = f",c{self.chunk}" if self.chunk else ""
        return f"{self.kind}[s{self.stage},m{self.microbatch}{extra}]"


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Result of :meth:`Schedule.simulate`.

    Attributes:
      spans: action -> ``(start, end)`` time.
      makespan: time at which the last action ends.
      busy: physical stage -> total time it spends computing.
      num_stages: number of physical stages.
    """

    spans: Mapping[Action, tuple[float, float]]
    makespan: float
    busy: Mapping[int, float]
    num_stages: int

    @property
    def bubble_fraction(self) -> float:
        """Idle fraction of the ``num_stages x makespan`` stage-time area."""
        if self.makespan <= 0:
            return 0.0
        total = self.num_stages * self.makespan
        return max(0.0, 1.0 - sum(self.busy.values()) / total)

    def start(self, action: Action) -> float:
        return self.spans[action][0]

    def end(self, action: Action) -> float:
        return self.spans[action][1]


def _has_weight_actions(actions: Iterable[object]) -> bool:
    return any(isinstance(a, Action) and a.kind == WEIGHT for a in actions)


def _check_count(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


class Schedule:
    """A pipeline schedule over ``num_stages`` device groups and ``num_microbatches``.

    Subclasses define :meth:`_build_per_stage_order`; everything else is
    derived.  Build arbitrary schedules with :meth:`from_order` or
    :meth:`from_per_stage_order`.  Instances are immutable; the list/dict
    properties return fresh copies.

    Attributes:
      name: short schedule name (``"gpipe"``, ``"1f1b"``, ``"interleaved"``...).
      num_stages: number of physical stages (device groups), ``S``.
      num_microbatches: ``M``.
      num_chunks: virtual stages per device group, ``V`` (1 unless interleaved).
      num_logical_stages: ``S * V``.
      forward_only: only forward actions (inference).
      split_backward: the backward is split into ``B`` (input gradient) and
        ``W`` (weight gradient) actions (zero-bubble schedules); always False
        when ``forward_only``.
    """

    name: str = "custom"

    def __init__(
        self,
        num_stages: int,
        num_microbatches: int,
        *,
        num_chunks: int = 1,
        forward_only: bool = False,
        split_backward: bool = False,
    ) -> None:
        self._init_common(num_stages, num_microbatches, num_chunks, forward_only, split_backward)
        per_stage = self._build_per_stage_order()
        self._set_per_stage(per_stage)
        self._order = self._derive_order()
        self.validate()

    # ------------------------------------------------------------------ set-up

    def _init_common(
        self,
        num_stages: int,
        num_microbatches: int,
        num_chunks: int,
        forward_only: bool,
        split_backward: bool,
    ) -> None:
        self._num_stages = _check_count("num_stages", num_stages)
        self._num_microbatches = _check_count("num_microbatches", num_microbatches)
        self._num_chunks = _check_count("num_chunks", num_chunks)
        self._forward_only = bool(forward_only)
        # nothing to split without a backward pass
        self._split = bool(split_backward) and not self._forward_only
        self._cache: dict[object, object] = {}

    def _build_per_stage_order(self) -> dict[int, list[Action]]:
        raise NotImplementedError(
            "Schedule subclasses implement _build_per_stage_order(); "
            "use Schedule.from_order / from_per_stage_order for explicit orders"
        )

    def _set_per_stage(self, per_stage: Mapping[int, Sequence[Action]]) -> None:
        extra = sorted(set(per_stage) - set(range(self._num_stages)))
        if extra:
            raise ValueError(
                f"per-stage order has stages {extra} outside 0..{self._num_stages - 1}"
            )
        self._per_stage: dict[int, tuple[Action, ...]] = {
            s: tuple(per_stage.get(s, ())) for s in range(self._num_stages)
        }
        for s, actions in self._per_stage.items():
            for a in actions:
                if not isinstance(a, Action):
                    raise ValueError(f"stage {s}: expected Action, got {a!r}")
                self._check_action(a)
                if self.physical_stage(a) != s:
                    raise ValueError(
                        f"{a} belongs to physical stage {self.physical_stage(a)} "
                        f"but is listed for stage {s}"
                    )

    def _derive_order(self) -> tuple[Action, ...]:
        """Global order: the default-cost timeline sorted by (start, stage)."""
        tl = self._simulate_raw(self._stage_costs(1.0, 2.0), 0.0)
        return tuple(
            sorted(
                tl.spans,
                key=lambda a: (tl.spans[a][0], self.physical_stage(a), a.kind, a.stage),
            )
        )

    @classmethod
    def from_order(
        cls,
        order: Iterable[Action],
        num_stages: int,
        num_microbatches: int,
        *,
        num_chunks: int = 1,
        forward_only: bool = False,
        split_backward: bool | None = None,
        name: str = "custom",
    ) -> Schedule:
        """A schedule with an explicit global order; each stage runs its actions
        in the order they appear.  Raises ``ValueError`` if the order is invalid.

        ``split_backward=None`` (the default) infers the split from the order:
        it is a split-backward schedule iff it holds a ``W`` action (then every
        ``B`` needs its ``W``).  Pass True/False to insist: ``False`` rejects
        ``W`` actions, ``True`` requires them.
        """
        order = tuple(order)
        if split_backward is None:
            split_backward = _has_weight_actions(order)
        self = cls.__new__(Schedule)
        self._init_common(num_stages, num_microbatches, num_chunks, forward_only, split_backward)
        self.name = name
        for a in order:
            if not isinstance(a, Action):
                raise ValueError(f"expected Action, got {a!r}")
            self._check_action(a)
        per_stage: dict[int, list[Action]] = {s: [] for s in range(self._num_stages)}
        for a in order:
            per_stage[self.physical_stage(a)].append(a)
        self._set_per_stage(per_stage)
        self._order = order
        self.validate()
        return self

    @classmethod
    def from_per_stage_order(
        cls,
        per_stage_order: Mapping[int, Sequence[Action]],
        num_stages: int,
        num_microbatches: int,
        *,
        num_chunks: int = 1,
        forward_only: bool = False,
        split_backward: bool | None = None,
        name: str = "custom",
    ) -> Schedule:
        """A schedule from each stage's own order; the global order is derived.
        Raises ``ValueError`` if the per-stage orders are incomplete or deadlock.

        ``split_backward``: as for :meth:`from_order` (``None`` infers it from
        the presence of ``W`` actions).
        """
        if split_backward is None:
            split_backward = _has_weight_actions(
                a for acts in per_stage_order.values() for a in acts
            )
        self = cls.__new__(Schedule)
        self._init_common(num_stages, num_microbatches, num_chunks, forward_only, split_backward)
        self.name = name
        self._set_per_stage(per_stage_order)
        self._check_complete([a for acts in self._per_stage.values() for a in acts])
        self._order = self._derive_order()
        self.validate()
        return self

    # ------------------------------------------------------------- attributes

    @property
    def num_stages(self) -> int:
        return self._num_stages

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches

    @property
    def num_chunks(self) -> int:
        return self._num_chunks

    @property
    def num_logical_stages(self) -> int:
        return self._num_stages * self._num_chunks

    @property
    def forward_only(self) -> bool:
        return self._forward_only

    @property
    def split_backward(self) -> bool:
        """True if the backward is split into ``B`` (input gradient) and ``W``
        (weight gradient) actions; False for GPipe/1F1B/interleaved and for
        every forward-only schedule."""
        return self._split

    @property
    def order(self) -> list[Action]:
        """Every action once, in a valid global (topological) order."""
        return list(self._order)

    @property
    def per_stage_order(self) -> dict[int, list[Action]]:
        """Physical stage -> its actions in the order that stage runs them."""
        return {s: list(acts) for s, acts in self._per_stage.items()}

    def __iter__(self) -> Iterator[Action]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def physical_stage(self, action: Action) -> int:
        """The device group (physical stage) that runs ``action``."""
        return action.stage % self._num_stages

    def action(self, stage: int, microbatch: int, kind: Kind) -> Action:
        """The :class:`Action` for logical ``stage`` (chunk filled in); ``kind``
        is ``"F"``, ``"B"`` or ``"W"``."""
        return Action(stage, microbatch, kind, stage // self._num_stages)

    def dependencies(self, action: Action) -> tuple[Action, ...]:
        """The actions that must finish before ``action`` may start."""
        l, m = action.stage, action.microbatch
        last = self.num_logical_stages - 1
        if action.kind == FORWARD:
            return (self.action(l - 1, m, FORWARD),) if l > 0 else ()
        if action.kind == WEIGHT:
            return (self.action(l, m, BACKWARD),)
        deps = [self.action(l, m, FORWARD)]
        if l < last:
            deps.append(self.action(l + 1, m, BACKWARD))
        return tuple(deps)

    def expected_actions(self) -> list[Action]:
        """All actions a complete schedule must contain (``W`` ones only when
        :attr:`split_backward`)."""
        kinds: tuple[Kind, ...] = (FORWARD,) if self._forward_only else (FORWARD, BACKWARD)
        if self._split:
            kinds += (WEIGHT,)
        return [
            self.action(l, m, k)
            for k in kinds
            for l in range(self.num_logical_stages)
            for m in range(self._num_microbatches)
        ]

    # ------------------------------------------------------------- validation

    def _check_action(self, a: Action) -> None:
        if a.stage >= self.num_logical_stages:
            raise ValueError(
                f"{a}: stage {a.stage} out of range for {self.num_logical_stages} "
                f"logical stages"
            )
        if a.microbatch >= self._num_microbatches:
            raise ValueError(
                f"{a}: microbatch {a.microbatch} out of range for "
                f"{self._num_microbatches} microbatches"
            )
        if a.chunk != a.stage // self._num_stages:
            raise ValueError(
                f"{a}: chunk {a.chunk} inconsistent with logical stage {a.stage} "
                f"(expected chunk {a.stage // self._num_stages} with "
                f"{self._num_stages} stages)"
            )
        if self._forward_only and a.kind != FORWARD:
            raise ValueError(f"{a}: backward action in a forward-only schedule")
        if a.kind == WEIGHT and not self._split:
            raise ValueError(
                f"{a}: weight-gradient (W) action in a schedule without a split backward "
                f"(split_backward=False, where B is the whole backward); W actions need "
                f"split_backward=True"
            )

    def _check_complete(self, actions: Sequence[Action]) -> None:
        seen: dict[Action, int] = {}
        for a in actions:
            seen[a] = seen.get(a, 0) + 1
        dup = [str(a) for a, n in seen.items() if n > 1]
        if dup:
            raise ValueError(f"actions scheduled more than once: {', '.join(dup[:10])}")
        missing = [a for a in self.expected_actions() if a not in seen]
        if missing:
            more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
            why = (
                "; a split-backward schedule (split_backward=True, e.g. one with W "
                "actions) needs a W after every B"
                if any(a.kind == WEIGHT for a in missing)
                else ""
            )
            raise ValueError(
                f"actions missing from schedule: {', '.join(map(str, missing[:10]))}{more}{why}"
            )

    def validate(self) -> None:
        """Check completeness and dependencies; raise ``ValueError`` if broken.

        Checks that every expected action appears exactly once, that each action
        comes after its dependencies in :attr:`order`, and that each stage's
        order is the projection of the global order onto that stage.
        """
        self._check_complete(self._order)
        pos = {a: i for i, a in enumerate(self._order)}
        for i, a in enumerate(self._order):
            for d in self.dependencies(a):
                if pos[d] > i:
                    raise ValueError(
                        f"invalid {self.name} schedule: {a} at position {i} runs before "
                        f"its dependency {d} at position {pos[d]}"
                    )
        for s, acts in self._per_stage.items():
            proj = tuple(a for a in self._order if self.physical_stage(a) == s)
            if proj != acts:
                raise ValueError(
                    f"invalid {self.name} schedule: stage {s}'s order disagrees with "
                    f"the global order"
                )

    # ------------------------------------------------------------- simulation

    def _stage_costs(self, forward: float, backward: float) -> dict[int, dict[str, float]]:
        """Every stage's per-kind action costs from a stage-chunk's forward and
        backward cost: a split backward costs half for ``B`` and half for ``W``."""
        b, w = (backward / 2, backward / 2) if self._split else (backward, backward)
        return {stage: {FORWARD: forward, BACKWARD: b, WEIGHT: w} for stage in self._per_stage}

    def _simulate_raw(
        self, costs: dict[int, dict[str, float]], comm_time: float
    ) -> Timeline:
        """List-schedule each stage's order with per-stage, per-kind action
        costs (``costs[stage][kind]``)."""
        for stage, of_kind in costs.items():
            if min(of_kind.values()) <= 0:
                raise ValueError(
                    f"costs must be positive, got forward={of_kind[FORWARD]}, "
                    f"backward={of_kind[BACKWARD]} on stage {stage}"
                )
        if comm_time < 0:
            raise ValueError(f"comm_time must be non-negative, got comm={comm_time}")
        queues = self._per_stage
        pos = {s: 0 for s in queues}
        free = {s: 0.0 for s in queues}
        busy = {s: 0.0 for s in queues}
        spans: dict[Action, tuple[float, float]] = {}
        remaining = sum(len(q) for q in queues.values())
        while remaining:
            progress = False
            for s, q in queues.items():
                while pos[s] < len(q):
                    a = q[pos[s]]
                    deps = self.dependencies(a)
                    if not all(d in spans for d in deps):
                        break
                    t = free[s]
                    for d in deps:
                        lat = comm_time if self.physical_stage(d) != s else 0.0
                        t = max(t, spans[d][1] + lat)
                    cost = costs[s][a.kind]
                    spans[a] = (t, t + cost)
                    free[s] = t + cost
                    busy[s] += cost
                    pos[s] += 1
                    remaining -= 1
                    progress = True
            if not progress:
                blocked = ", ".join(
                    f"stage {s} waits at {q[pos[s]]}"
                    for s, q in queues.items()
                    if pos[s] < len(q)
                )
                raise ValueError(f"invalid {self.name} schedule: deadlock ({blocked})")
        makespan = max((e for _, e in spans.values()), default=0.0)
        return Timeline(spans, makespan, busy, self._num_stages)

    def simulate(
        self,
        forward_time: float = 1.0,
        backward_time: float = 2.0,
        comm_time: float = 0.0,
        stage_times: Mapping[int, tuple[float, float]] | None = None,
    ) -> Timeline:
        """Simulated timeline.

        ``forward_time``/``backward_time`` are the cost of a whole stage's
        forward/backward for one microbatch; each of the ``V`` chunks of an
        interleaved stage costs ``1/V`` of it.  With :attr:`split_backward`,
        ``B`` and ``W`` each cost half the backward.  ``comm_time`` is added on
        every cross-stage dependency.  ``stage_times``: ``{stage: (forward,
        backward)}`` for stages whose costs differ from the others' (an
        unbalanced pipeline).
        """
        own = tuple(sorted((stage_times or {}).items()))
        key = ("sim", forward_time, backward_time, comm_time, own)
        if key not in self._cache:
            v = self._num_chunks
            costs = self._stage_costs(forward_time / v, backward_time / v)
            costs.update({stage: self._stage_costs(f / v, b / v)[stage] for stage, (f, b) in own})
            self._cache[key] = self._simulate_raw(costs, comm_time)
        return self._cache[key]  # type: ignore[return-value]

    def timeline(
        self,
        forward_time: float = 1.0,
        backward_time: float = 2.0,
        comm_time: float = 0.0,
    ) -> dict[Action, tuple[float, float]]:
        """Action -> ``(start, end)``; see :meth:`simulate`."""
        return dict(self.simulate(forward_time, backward_time, comm_time).spans)

    def bubble(
        self,
        forward_time: float = 1.0,
        backward_time: float = 2.0,
        comm_time: float = 0.0,
    ) -> float:
        """Bubble (idle) fraction under the given cost model."""
        return self.simulate(forward_time, backward_time, comm_time).bubble_fraction

    @property
    def bubble_fraction(self) -> float:
        """Bubble fraction with the default costs (F = 1, B = 2, no comm; split:
        F = B = W = 1)."""
        return self.bubble()

    @property
    def peak_live_activations(self) -> dict[int, int]:
        """Physical stage -> peak number of (logical stage, microbatch) pairs whose
        forward has run on it and whose backward has not finished.

        The backward finishes with ``B``, or with ``W`` in a split-backward
        schedule (``W`` still reads the stashed forward inputs, so a
        microbatch's activations stay live from its ``F`` until its ``W``).
        For interleaved schedules each pair holds one chunk's activations
        (``1/V`` of the stage's layers).  Forward-only schedules keep nothing
        for a backward pass: 0 everywhere.
        """
        release = WEIGHT if self._split else BACKWARD
        out: dict[int, int] = {}
        for s, acts in self._per_stage.items():
            live = peak = 0
            if not self._forward_only:
                for a in acts:
                    if a.kind == FORWARD:
                        live += 1
                    elif a.kind == release:
                        live -= 1
                    peak = max(peak, live)
            out[s] = peak
        return out

    # ---------------------------------------------------------------- display

    def render(self, backward_slots: int = 1) -> str:
        """Text diagram: one row per physical stage, one column per time slot.

        Every action takes one slot (a backward ``backward_slots``; in a split
        schedule ``B`` and ``W`` each ``backward_slots``); cells show
        ``F3``/``B3``/``W3`` (``F3.1`` = chunk 1) or ``.`` when the stage is idle.
        """
        if not isinstance(backward_slots, int) or backward_slots < 1:
            raise ValueError(f"backward_slots must be a positive int, got {backward_slots!r}")
        slots = float(backward_slots)
        tl = self._simulate_raw({st: {FORWARD: 1.0, BACKWARD: slots, WEIGHT: slots} for st in self._per_stage}, 0.0)
        width = int(round(tl.makespan))
        grid = [["."] * width for _ in range(self._num_stages)]
        for a, (start, end) in tl.spans.items():
            for t in range(int(round(start)), int(round(end))):
                grid[self.physical_stage(a)][t] = a.label
        cell = max([len(c) for row in grid for c in row] + [1])
        label = len(f"stage {self._num_stages - 1}")
        lines = []
        for s, row in enumerate(grid):
            cells = " ".join(c.ljust(cell) for c in row).rstrip()
            lines.append(f"{f'stage {s}'.ljust(label)} | {cells}")
        return "\n".join(lines)

    def _describe(self) -> str:
        extra = f", num_chunks={self._num_chunks}" if self._num_chunks > 1 else ""
        fo = ", forward_only=True" if self._forward_only else ""
        split = ", split_backward=True" if self._split and type(self) is Schedule else ""
        return (
            f"num_stages={self._num_stages}, num_microbatches={self._num_microbatches}"
            f"{extra}{fo}{split}"
        )

    def __repr__(self) -> str:
        cls = type(self).__name__
        name = f"name={self.name!r}, " if cls == "Schedule" else ""
        return (
            f"{cls}({name}{self._describe()}, bubble_fraction={self.bubble_fraction:.3f}, "
            f"peak_live_activations={self.peak_live_activations})"
        )

    def __str__(self) -> str:
        return f"{self!r}\n{self.render()}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return (
            self._num_stages == other._num_stages
            and self._num_microbatches == other._num_microbatches
            and self._num_chunks == other._num_chunks
            and self._forward_only == other._forward_only
            and self._split == other._split
            and self._order == other._order
        )

    def __hash__(self) -> int:
        return hash(
            (self._num_stages, self._num_microbatches, self._num_chunks, self._split, self._order)
        )


# ---------------------------------------------------------------- schedules


class GPipe(Schedule):
    """GPipe: every stage runs all forwards, then all backwards (in microbatch
    order).  Peak live activations: ``M`` on every stage."""

    name = "gpipe"

    def __init__(self, num_stages: int, num_microbatches: int, *, forward_only: bool = False):
        super().__init__(num_stages, num_microbatches, forward_only=forward_only)

    def _build_per_stage_order(self) -> dict[int, list[Action]]:
        M = self.num_microbatches
        out = {}
        for s in range(self.num_stages):
            acts = [Action(s, m, FORWARD) for m in range(M)]
            if not self.forward_only:
                acts += [Action(s, m, BACKWARD) for m in range(M)]
            out[s] = acts
        return out


class OneFOneB(Schedule):
    """1F1B (PipeDream-flush): stage ``s`` runs ``min(S-1-s, M)`` warm-up
    forwards, then alternates one forward / one backward, then drains the
    remaining backwards.  Peak live activations on stage ``s``: ``min(S-s, M)``.
    Same bubble as GPipe, much less activation memory."""

    name = "1f1b"

    def __init__(self, num_stages: int, num_microbatches: int, *, forward_only: bool = False):
        super().__init__(num_stages, num_microbatches, forward_only=forward_only)

    def _build_per_stage_order(self) -> dict[int, list[Action]]:
        S, M = self.num_stages, self.num_microbatches
        out = {}
        for s in range(S):
            if self.forward_only:
                out[s] = [Action(s, m, FORWARD) for m in range(M)]
                continue
            warmup = min(S - 1 - s, M)
            acts = [Action(s, m, FORWARD) for m in range(warmup)]
            for i in range(M - warmup):
                acts.append(Action(s, warmup + i, FORWARD))
                acts.append(Action(s, i, BACKWARD))
            acts += [Action(s, m, BACKWARD) for m in range(M - warmup, M)]
            out[s] = acts
        return out


class Interleaved1F1B(Schedule):
    """Interleaved 1F1B (Megatron-LM virtual pipeline stages).

    Each of the ``S`` device groups holds ``num_chunks`` (``V``) model chunks;
    logical stage ``l = chunk * S + group``.  Microbatches go through in rounds
    of ``S``: a round's forwards run chunk 0 for its ``S`` microbatches, then
    chunk 1, ...; backwards likewise with the chunks reversed.  Device group
    ``g`` warms up with ``min(2 (S-1-g) + (V-1) S, M V)`` forwards, then
    alternates forward/backward, then drains (``V = 1`` is exactly
    :class:`OneFOneB`).  Bubble ``(S-1)/(V M + S-1)`` instead of 1F1B's
    ``(S-1)/(M + S-1)``, at the cost of more (smaller) activations in flight
    and ``V`` times more point-to-point transfers.

    Requires ``num_microbatches % num_stages == 0`` (as Megatron-LM does).  Use
    :meth:`from_logical` to give the number of logical stages instead.
    """

    name = "interleaved"

    def __init__(
        self,
        num_stages: int,
        num_microbatches: int,
        num_chunks: int = 2,
        *,
        forward_only: bool = False,
    ):
        S = _check_count("num_stages", num_stages)
        M = _check_count("num_microbatches", num_microbatches)
        _check_count("num_chunks", num_chunks)
        if M % S:
            raise ValueError(
                f"interleaved schedule needs num_microbatches divisible by num_stages, "
                f"got num_microbatches={M} and num_stages={S}"
            )
        super().__init__(S, M, num_chunks=num_chunks, forward_only=forward_only)

    @classmethod
    def from_logical(
        cls,
        num_logical_stages: int,
        num_microbatches: int,
        num_chunks: int = 2,
        *,
        forward_only: bool = False,
    ) -> Interleaved1F1B:
        """Build from the number of logical stages (e.g. tasks) and chunks per group."""
        _check_count("num_logical_stages", num_logical_stages)
        _check_count("num_chunks", num_chunks)
        if num_logical_stages % num_chunks:
            raise ValueError(
                f"num_logical_stages={num_logical_stages} is not divisible by "
                f"num_chunks={num_chunks}"
            )
        return cls(
            num_logical_stages // num_chunks,
            num_microbatches,
            num_chunks,
            forward_only=forward_only,
        )

    def _nth(self, group: int, k: int, kind: Kind) -> Action:
        S, V = self.num_stages, self.num_chunks
        within = k % (S * V)
        chunk = within // S
        if kind == BACKWARD:
            chunk = V - 1 - chunk
        mb = (k // (S * V)) * S + k % S
        return self.action(chunk * S + group, mb, kind)

    def _build_per_stage_order(self) -> dict[int, list[Action]]:
        S, M, V = self.num_stages, self.num_microbatches, self.num_chunks
        total = M * V
        out = {}
        for g in range(S):
            if self.forward_only:
                out[g] = [self._nth(g, k, FORWARD) for k in range(total)]
                continue
            if V == 1:  # plain 1F1B
                warmup = min(S - 1 - g, total)
            else:
                warmup = min(2 * (S - 1 - g) + (V - 1) * S, total)
            acts = [self._nth(g, k, FORWARD) for k in range(warmup)]
            for i in range(total - warmup):
                acts.append(self._nth(g, warmup + i, FORWARD))
                acts.append(self._nth(g, i, BACKWARD))
            acts += [self._nth(g, k, BACKWARD) for k in range(total - warmup, total)]
            out[g] = acts
        return out


def _zero_bubble_order(num_stages: int, num_microbatches: int, caps: Sequence[int]) -> dict[int, list[Action]]:
    """Per-stage orders of a zero-bubble schedule with at most ``caps[s]`` live
    microbatches on stage ``s``.

    A list scheduler in unit time steps (F = B = W = 1, the default costs of a
    split schedule): at every step each idle stage runs, in this priority,

    1. its next ``B`` if ready (input gradients are on the critical path:
       the previous stage waits for them);
    2. else its next ``F`` if ready and fewer than ``caps[s]`` microbatches
       are live on it (forwarded, ``W`` not yet run);
    3. else its oldest pending ``W`` (weight gradients fill what would be
       bubbles, and free a live slot for the next ``F``);

    and otherwise idles.  ``F`` and ``B`` run in microbatch order.  It cannot
    deadlock: the last stage's ``B`` only needs its own ``F``, and a stage
    whose live slots are full either holds a pending ``W`` or waits for a
    ``B`` that the stages after it will deliver.
    """
    S, M = num_stages, num_microbatches
    end: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, microbatch) -> end step
    next_f = [0] * S
    next_b = [0] * S
    pending_w: list[list[int]] = [[] for _ in range(S)]
    live = [0] * S
    out: dict[int, list[Action]] = {s: [] for s in range(S)}
    total = 3 * S * M
    t = 0

    def done(kind: Kind, s: int, m: int) -> bool:  # finished before step t
        return (kind, s, m) in end and end[(kind, s, m)] <= t

    while len(end) < total:
        finished: dict[tuple[Kind, int, int], int] = {}
        for s in range(S):
            m = next_b[s]
            if m < next_f[s] and done(FORWARD, s, m) and (s == S - 1 or done(BACKWARD, s + 1, m)):
                kind: Kind = BACKWARD
                next_b[s] += 1
                pending_w[s].append(m)
            elif (
                next_f[s] < M
                and live[s] < caps[s]
                and (s == 0 or done(FORWARD, s - 1, next_f[s]))
            ):
                kind, m = FORWARD, next_f[s]
                next_f[s] += 1
                live[s] += 1
            elif pending_w[s]:
                kind, m = WEIGHT, pending_w[s].pop(0)
                live[s] -= 1
            else:
                continue
            out[s].append(Action(s, m, kind))
            finished[(kind, s, m)] = t + 1
        end.update(finished)
        t += 1
        if t > 2 * total + S:  # unreachable (see above); never loop forever
            raise RuntimeError(f"zero-bubble construction stalled for caps={list(caps)}")
    return out


class _ZeroBubble(Schedule):
    """Shared construction of the zero-bubble schedules (see subclasses)."""

    def __init__(self, num_stages: int, num_microbatches: int, *, forward_only: bool = False):
        super().__init__(
            num_stages, num_microbatches, forward_only=forward_only, split_backward=True
        )

    def _live_cap(self, stage: int) -> int:
        raise NotImplementedError

    def _build_per_stage_order(self) -> dict[int, list[Action]]:
        S, M = self.num_stages, self.num_microbatches
        if self.forward_only:  # as 1F1B forward-only
            return {s: [Action(s, m, FORWARD) for m in range(M)] for s in range(S)}
        return _zero_bubble_order(S, M, [min(self._live_cap(s), M) for s in range(S)])


class ZeroBubbleH1(_ZeroBubble):
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with the
    backward split into ``B`` (input gradient) and ``W`` (weight gradient).

    Stage ``s`` warms up like 1F1B (``min(S-s, M)`` forwards before its first
    ``B``), runs each ``B`` as soon as it can (``B`` ahead of ``W``: the
    previous stage waits for it) and defers ``W`` into what 1F1B leaves as
    bubbles, never holding more live microbatches than 1F1B: peak live
    activations ``min(S-s, M)`` on stage ``s``, counted until ``W``.  Built by
    a list scheduler at unit costs (``B`` first, then ``F`` within the cap,
    else the oldest pending ``W``).

    Bubble, default costs (F = B = W = 1): ``2(S-1)/(3M + 2(S-1))`` for every
    ``M``, against 1F1B's ``3(S-1)/(3M + 3(S-1))``: each stage idles
    ``(S-1)(F+B)`` instead of ``(S-1)(F+B+W)``.  This is the least any
    schedule can do under the per-stage memory bound: the last stage may hold
    one microbatch, so it must run ``F B W`` back to back, and the last ``B``
    then still crosses ``S-1`` stages.  (The paper's ``(S-1)(F+B-W)`` needs
    later stages to keep more microbatches between their ``B`` and ``W`` than
    1F1B keeps; here ``W`` keeps a microbatch's activations live, so that
    memory is :class:`ZeroBubbleH2`'s trade.)

    Example::

        >>> s = ZeroBubbleH1(2, 3)
        >>> print(s.render())
        stage 0 | F0 F1 .  B0 W0 F2 B1 W1 .  B2 W2
        stage 1 | .  F0 B0 W0 F1 B1 W1 F2 B2 W2 .
        >>> s.peak_live_activations, round(s.bubble_fraction, 4)   # 2/11
        ({0: 2, 1: 1}, 0.1818)
    """

    name = "zb-h1"

    def _live_cap(self, stage: int) -> int:
        return self.num_stages - stage


class ZeroBubbleH2(_ZeroBubble):
    """ZB-H2 (after Qi et al. 2023): more warm-up forwards, more memory, (almost)
    no bubble.

    Same construction as :class:`ZeroBubbleH1` with a larger live-microbatch
    cap: stage ``s`` keeps up to ``2S-1-s`` microbatches live, so its peak
    live activations are exactly ``min(2S-1-s, M)`` (stage 0: ``2S-1``, as
    the paper's H2; the last stage: ``S`` instead of 1).  Stage ``s`` fills
    its warm-up bubble with ``min(2(S-s)-1, M)`` forwards before its first
    ``B`` and the drain with deferred ``W``.

    This is a documented variant of the paper's H2, which bounds stage ``s``
    by ``2(S-s)-1`` microbatches counting only the weight-gradient stash
    after ``B``; here ``W`` keeps a microbatch's activations live, and with
    that accounting the paper's per-stage bound gives no better bubble than
    H1 (its last stage could hold one microbatch), hence ``2S-1-s``.

    Bubble, default costs (F = B = W = 1): ``(S-1)/(3M + S-1)`` for ``M >= S``
    (each stage idles ``S-1`` forward times: the least possible, as the
    last stage cannot start earlier); never above :class:`ZeroBubbleH1`'s.

    Example::

        >>> s = ZeroBubbleH2(2, 3)
        >>> print(s.render())
        stage 0 | F0 F1 F2 B0 W0 B1 W1 .  B2 W2
        stage 1 | .  F0 B0 F1 B1 W0 F2 B2 W1 W2
        >>> s.peak_live_activations, round(s.bubble_fraction, 4)   # 1/10
        ({0: 3, 1: 2}, 0.1)
    """

    name = "zb-h2"

    def _live_cap(self, stage: int) -> int:
        return 2 * self.num_stages - 1 - stage


# ------------------------------------------------------------------ factory

_REGISTRY: dict[str, type[Schedule]] = {
    "gpipe": GPipe,
    "1f1b": OneFOneB,
    "interleaved": Interleaved1F1B,
    "zb-h1": ZeroBubbleH1,
    "zb-h2": ZeroBubbleH2,
}
_ALIASES: dict[str, str] = {
    "one_f_one_b": "1f1b",
    "onefoneb": "1f1b",
    "pipedream_flush": "1f1b",
    "interleaved_1f1b": "interleaved",
    "interleaved1f1b": "interleaved",
    "zero-bubble": "zb-h1",
    "zero-bubble-h1": "zb-h1",
    "zbh1": "zb-h1",
    "zero-bubble-h2": "zb-h2",  # NVIDIA MultiMesh's name
    "zbh2": "zb-h2",
}
KNOWN_SCHEDULES: tuple[str, ...] = tuple(_REGISTRY) + tuple(_ALIASES)


def _normalise_name(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


_LOOKUP: dict[str, str] = {
    **{_normalise_name(k): k for k in _REGISTRY},
    **{_normalise_name(a): k for a, k in _ALIASES.items()},
}


def get_schedule(
    name_or_obj: str | Schedule | type[Schedule],
    num_stages: int,
    num_microbatches: int,
    **kwargs: object,
) -> Schedule:
    """Return a schedule by name, or check a given one.

    Args:
      name_or_obj: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (alias
        ``"interleaved_1f1b"``), ``"zb-h1"`` (aliases ``"zero-bubble"``,
        ``"zero-bubble-h1"``, ``"zbh1"``), ``"zb-h2"`` (alias
        ``"zero-bubble-h2"``); case-insensitive, ``-``/space read as ``_``;
        a :class:`Schedule` subclass, or a :class:`Schedule` instance (checked
        against ``num_stages``/``num_microbatches`` and any ``kwargs``).
      num_stages: physical stages (device groups).
      num_microbatches: microbatches.
      **kwargs: ``forward_only``; ``num_chunks`` (alias ``interleave``) for
        the interleaved schedule (``None`` or 1 is accepted by the others).

    Raises:
      ValueError: unknown name, non-positive counts, or a mismatching instance.
    """
    _check_count("num_stages", num_stages)
    _check_count("num_microbatches", num_microbatches)
    kwargs = dict(kwargs)
    if "interleave" in kwargs:
        if "num_chunks" in kwargs:
            raise ValueError("give only one of 'interleave' and 'num_chunks'")
        kwargs["num_chunks"] = kwargs.pop("interleave")
    if kwargs.get("num_chunks", 0) is None:
        kwargs.pop("num_chunks")

    if isinstance(name_or_obj, Schedule):
        s = name_or_obj
        if (s.num_stages, s.num_microbatches) != (num_stages, num_microbatches):
            raise ValueError(
                f"schedule {s.name!r} was built for num_stages={s.num_stages}, "
                f"num_microbatches={s.num_microbatches}, but the pipeline has "
                f"num_stages={num_stages}, num_microbatches={num_microbatches}"
            )
        for key, want in kwargs.items():
            have = getattr(s, key, None)
            if have != want:
                raise ValueError(f"schedule {s.name!r} has {key}={have!r}, but {want!r} was asked")
        s.validate()
        return s

    if isinstance(name_or_obj, type) and issubclass(name_or_obj, Schedule):
        cls = name_or_obj
    elif isinstance(name_or_obj, str):
        key = _LOOKUP.get(_normalise_name(name_or_obj))
        if key is None:
            raise ValueError(
                f"unknown pipeline schedule {name_or_obj!r}; known schedules: "
                f"{', '.join(KNOWN_SCHEDULES)} (or a Schedule instance)"
            )
        cls = _REGISTRY[key]
    else:
        raise ValueError(
            f"schedule must be a name ({', '.join(_REGISTRY)}) or a Schedule, "
            f"got {name_or_obj!r}"
        )

    if cls is not Interleaved1F1B and "num_chunks" in kwargs:
        chunks = kwargs.pop("num_chunks")
        if chunks != 1:
            raise ValueError(
                f"num_chunks/interleave={chunks!r} needs the 'interleaved' schedule, "
                f"not {cls.name!r}"
            )
    return cls(num_stages, num_microbatches, **kwargs)  # type: ignore[arg-type]
