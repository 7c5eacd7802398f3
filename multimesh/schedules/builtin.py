"""The named schedules: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-H2, and `get_schedule` by name."""

from __future__ import annotations

from collections.abc import Sequence

from .actions import BACKWARD, FORWARD, WEIGHT, Action, Kind, check_count
from .order import Schedule

__all__ = ["KNOWN_SCHEDULES", "GPipe", "Interleaved1F1B", "OneFOneB", "ZeroBubbleH1", "ZeroBubbleH2", "get_schedule"]


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
        S = check_count("num_stages", num_stages)
        M = check_count("num_microbatches", num_microbatches)
        check_count("num_chunks", num_chunks)
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
        check_count("num_logical_stages", num_logical_stages)
        check_count("num_chunks", num_chunks)
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
    check_count("num_stages", num_stages)
    check_count("num_microbatches", num_microbatches)
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
        for asked, want in kwargs.items():
            have = getattr(s, asked, None)
            if have != want:
                raise ValueError(f"schedule {s.name!r} has {asked}={have!r}, but {want!r} was asked")
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
