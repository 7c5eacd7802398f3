"""Pipeline schedules: the order in which microbatch forward/backward work runs.

A pipeline of ``S`` *stages* (device groups, i.e. task submeshes) processes ``M``
*microbatches*.  Each unit of work is an `Action`: the forward (``"F"``)
or backward (``"B"``) pass of one microbatch on one stage, or, in a schedule
that splits the backward (zero-bubble schedules), its input-gradient
(``"B"``) and weight-gradient (``"W"``) halves.  A `Schedule`
fixes, for every stage, the order in which that stage runs its actions, and
from it derives a global order (a valid topological order of the dependency
DAG), a simulated timeline, the bubble fraction and the peak number of live
microbatch activations per stage.  Everything here is pure Python; no JAX.

The package: `actions` (the units of work, the pipeline's shape and dependencies), `order`
(`Schedule`), `validate`, `simulate`, `render` (text) and `plot` (a picture, matplotlib), and
`builtin` (the named schedules, `get_schedule`).

Worked example::

    >>> from multimesh.schedules import get_schedule
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
  stages ``g, g + S, g + 2S, ...``).  `Action.stage` is the logical
  stage, `Action.chunk` its chunk, and `Schedule.physical_stage`
  the device group that runs it.
* Dependencies: ``F(l, m)`` after ``F(l-1, m)``; ``B(l, m)`` after ``F(l, m)``
  and after ``B(l+1, m)`` (the last logical stage's backward only needs its own
  forward); ``W(l, m)`` after ``B(l, m)``.
* Split backward (`Schedule.split_backward`, the zero-bubble schedules):
  ``B`` is then only the input-gradient pass (on the critical path: stage
  ``l-1`` waits for it) and ``W`` (weight gradient) the rest of the same
  (stage, microbatch)'s backward; every ``B`` has its ``W``.  Schedules without
  a split (GPipe, 1F1B, interleaved) have no ``W`` actions and ``B`` is the
  whole backward.  An explicit order (`Schedule.from_order`,
  `Schedule.from_per_stage_order`) is split iff it holds a ``W``
  action, unless ``split_backward=`` says otherwise.
* Time model (`Schedule.simulate`): a forward of a whole stage takes
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
* Live activations (`Schedule.peak_live_activations`): a microbatch's
  activations on a stage are live from its ``F`` until its backward has run:
  until ``B`` without a split, until ``W`` with one (``W`` still reads the
  stashed forward inputs).
* ``forward_only=True`` (inference) gives only ``F`` actions; then nothing is
  stashed for a backward pass and the peak live activations are 0.  There is
  no backward to split either: a forward-only schedule has
  ``split_backward=False`` (the zero-bubble schedules then equal 1F1B's).
"""

from .actions import BACKWARD, FORWARD, WEIGHT, Action, Kind, PipelineShape
from .builtin import KNOWN_SCHEDULES, GPipe, Interleaved1F1B, OneFOneB, ZeroBubbleH1, ZeroBubbleH2, get_schedule
from .order import Schedule
from .plot import plot_schedule
from .simulate import Timeline

__all__ = [
    "BACKWARD",
    "FORWARD",
    "KNOWN_SCHEDULES",
    "WEIGHT",
    "Action",
    "GPipe",
    "Interleaved1F1B",
    "Kind",
    "OneFOneB",
    "PipelineShape",
    "Schedule",
    "Timeline",
    "ZeroBubbleH1",
    "ZeroBubbleH2",
    "get_schedule",
    "plot_schedule",
]
