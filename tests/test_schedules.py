"""Tests for the pipeline schedule objects (pure Python, no devices)."""

from __future__ import annotations

import doctest
import importlib
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import multimesh.schedules as sched_mod
from multimesh.schedules import (
    KNOWN_SCHEDULES,
    Action,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    ZeroBubbleH1,
    ZeroBubbleH2,
    get_schedule,
)

SIZES = [1, 2, 4, 8]


def closed_form(S: int, M: int, V: int = 1) -> float:
    return (S - 1) / (V * M + S - 1)


def expected_actions(
    S: int, M: int, V: int = 1, forward_only: bool = False, split: bool = False
) -> Counter:
    kinds = "F" if forward_only else ("FBW" if split else "FB")
    return Counter(
        Action(l, m, k, l // S) for k in kinds for l in range(S * V) for m in range(M)
    )


def assert_topological(order: list[Action], L: int) -> None:
    """Independent dependency check (does not use Schedule.dependencies)."""
    done: set[tuple[str, int, int]] = set()
    for a in order:
        l, m = a.stage, a.microbatch
        if a.kind == "F":
            assert l == 0 or ("F", l - 1, m) in done, f"{a} before F of stage {l - 1}"
        elif a.kind == "W":
            assert ("B", l, m) in done, f"{a} before its B"
        else:
            assert ("F", l, m) in done, f"{a} before its forward"
            assert l == L - 1 or ("B", l + 1, m) in done, f"{a} before B of stage {l + 1}"
        done.add((a.kind, l, m))


def all_schedules(S: int, M: int, forward_only: bool = False) -> list[Schedule]:
    out: list[Schedule] = [
        GPipe(S, M, forward_only=forward_only),
        OneFOneB(S, M, forward_only=forward_only),
    ]
    if M % S == 0:
        out += [Interleaved1F1B(S, M, V, forward_only=forward_only) for V in (2, 3)]
    return out


def check_invariants(s: Schedule) -> None:
    S, M, V = s.num_stages, s.num_microbatches, s.num_chunks
    order = s.order
    assert Counter(order) == expected_actions(S, M, V, s.forward_only, s.split_backward)
    assert len(order) == len(set(order)) == len(s)
    assert_topological(order, S * V)
    per = s.per_stage_order
    assert sorted(per) == list(range(S))
    for p, acts in per.items():
        assert acts == [a for a in order if a.stage % S == p]
        assert all(s.physical_stage(a) == p for a in acts)
        assert all(a.chunk == a.stage // S for a in acts)
    s.validate()
    tl = s.simulate()
    for a in order:
        start, end = tl.spans[a]
        assert end > start
        for d in s.dependencies(a):
            assert tl.spans[d][1] <= start
    for p, acts in per.items():
        ends = [tl.spans[a] for a in acts]
        assert all(e0[1] <= e1[0] for e0, e1 in zip(ends, ends[1:])), "stage overlaps"
    assert 0.0 <= s.bubble_fraction < 1.0


# ----------------------------------------------------------- validity grid


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("M", SIZES)
@pytest.mark.parametrize("S", SIZES)
def test_every_schedule_valid_and_complete(S, M, forward_only):
    schedules = all_schedules(S, M, forward_only)
    assert len(schedules) == (4 if M % S == 0 else 2)
    for s in schedules:
        check_invariants(s)
        if forward_only:
            assert all(a.kind == "F" for a in s.order)


@pytest.mark.parametrize("M", SIZES)
@pytest.mark.parametrize("S", SIZES)
def test_gpipe_peak_and_order(S, M):
    s = GPipe(S, M)
    assert s.peak_live_activations == {p: M for p in range(S)}
    for p, acts in s.per_stage_order.items():
        assert [a.label for a in acts] == [f"F{m}" for m in range(M)] + [f"B{m}" for m in range(M)]


@pytest.mark.parametrize("M", SIZES)
@pytest.mark.parametrize("S", SIZES)
def test_1f1b_peak_live_activations(S, M):
    s = OneFOneB(S, M)
    assert s.peak_live_activations == {p: min(S - p, M) for p in range(S)}
    # warm-up of min(S-1-s, M) forwards, then the first backward comes right after one more F
    for p, acts in s.per_stage_order.items():
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        assert first_b == min(S - p, M)


@pytest.mark.parametrize("M", SIZES)
@pytest.mark.parametrize("S", SIZES)
@pytest.mark.parametrize("cls", [GPipe, OneFOneB])
def test_bubble_closed_form(cls, S, M):
    s = cls(S, M)
    cf = closed_form(S, M)
    assert s.bubble(1.0, 1.0) == pytest.approx(cf)
    assert s.bubble(1.0, 2.0) == pytest.approx(cf)  # independent of the F/B ratio
    assert s.bubble_fraction == pytest.approx(cf)
    # makespan = (M + S - 1) (F + B)
    assert s.simulate(1.0, 2.0).makespan == pytest.approx(3 * (M + S - 1))


@pytest.mark.parametrize("V", [2, 3, 4])
@pytest.mark.parametrize("S,M", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (2, 8)])
def test_interleaved_bubble_lower_than_1f1b(S, M, V):
    inter = Interleaved1F1B(S, M, V)
    plain = OneFOneB(S, M)
    assert inter.bubble_fraction < plain.bubble_fraction
    assert inter.bubble(1.0, 1.0) == pytest.approx(closed_form(S, M, V))
    assert inter.bubble(1.0, 2.0) == pytest.approx(closed_form(S, M, V))
    assert inter.num_logical_stages == S * V


def test_interleaved_one_chunk_is_1f1b():
    for S, M in [(2, 4), (4, 8), (4, 4)]:
        assert Interleaved1F1B(S, M, 1).per_stage_order == OneFOneB(S, M).per_stage_order


def test_interleaved_layout_and_from_logical():
    s = Interleaved1F1B(4, 8, 2)
    stages_on_group = {p: sorted({a.stage for a in acts}) for p, acts in s.per_stage_order.items()}
    assert stages_on_group == {0: [0, 4], 1: [1, 5], 2: [2, 6], 3: [3, 7]}
    assert Interleaved1F1B.from_logical(8, 8, 2) == s
    with pytest.raises(ValueError, match="not divisible"):
        Interleaved1F1B.from_logical(7, 8, 2)
    # first forward group on group 0: chunk 0 for microbatches 0..S-1, then chunk 1
    assert [a.label for a in s.per_stage_order[0][:8]] == [
        "F0", "F1", "F2", "F3", "F0.1", "F1.1", "F2.1", "F3.1",
    ]


def test_interleaved_needs_divisible_microbatches():
    with pytest.raises(ValueError, match=r"num_microbatches=6 and num_stages=4"):
        Interleaved1F1B(4, 6, 2)
    with pytest.raises(ValueError, match="divisible"):
        get_schedule("interleaved", 4, 2, interleave=2)


def test_forward_only():
    for s in [GPipe(4, 8, forward_only=True), OneFOneB(4, 8, forward_only=True)]:
        assert s.forward_only
        assert s.peak_live_activations == {p: 0 for p in range(4)}
        assert s.bubble_fraction == pytest.approx(closed_form(4, 8))
        assert len(s.order) == 4 * 8
    assert GPipe(3, 5, forward_only=True).order == OneFOneB(3, 5, forward_only=True).order
    i = Interleaved1F1B(2, 4, 2, forward_only=True)
    assert len(i.order) == 2 * 4 * 2 and all(a.kind == "F" for a in i.order)
    with pytest.raises(ValueError, match="forward-only"):
        Schedule.from_order(GPipe(2, 2).order, 2, 2, forward_only=True)


def test_comm_time_lengthens_timeline():
    s = OneFOneB(4, 4)
    base = s.simulate().makespan
    slow = s.simulate(comm_time=0.5).makespan
    assert slow > base
    assert s.bubble(comm_time=0.5) > s.bubble()
    one = OneFOneB(1, 4)
    assert one.simulate(comm_time=5.0).makespan == one.simulate().makespan  # no cross-stage edges
    with pytest.raises(ValueError, match="positive"):
        s.simulate(forward_time=0.0)


@pytest.mark.parametrize("M", [1, 4, 7])
def test_a_slow_stage_sets_the_pace(M):
    """Stage 1 twice as slow as stage 0 (forward 2 vs 1, backward 4 vs 2): GPipe's forwards leave stage 1 at
    2M + 1, its M backwards take 4M, and stage 0's last backward 2 more."""
    s = GPipe(2, M)
    assert s.simulate(stage_times={0: (1.0, 2.0), 1: (2.0, 4.0)}).makespan == pytest.approx(6 * M + 3)
    assert s.simulate(2.0, 4.0).makespan == pytest.approx(6 * (M + 1))  # both stages as slow as stage 1
    assert s.simulate(1.0, 2.0, stage_times={1: (1.0, 2.0)}).makespan == s.simulate(1.0, 2.0).makespan
    with pytest.raises(ValueError, match="stage 1"):
        s.simulate(stage_times={1: (0.0, 2.0)})


def test_timeline_dict_matches_simulate():
    s = GPipe(2, 2)
    tl = s.timeline(1.0, 1.0)
    assert tl[s.action(0, 0, "F")] == (0.0, 1.0)
    assert tl[s.action(1, 0, "F")] == (1.0, 2.0)
    assert tl[s.action(1, 1, "B")] == (4.0, 5.0)
    assert tl[s.action(0, 1, "B")] == (5.0, 6.0)
    assert s.simulate(1.0, 1.0).makespan == 6.0


# ------------------------------------------------------------ validation


def test_from_order_accepts_valid_and_rejects_dependency_violation():
    good = OneFOneB(3, 3).order
    custom = Schedule.from_order(good, 3, 3, name="mine")
    assert custom.order == good and custom.name == "mine"
    assert custom.peak_live_activations == OneFOneB(3, 3).peak_live_activations
    bad = list(good)
    i = bad.index(Action(1, 0, "F"))
    j = bad.index(Action(0, 0, "F"))
    bad[i], bad[j] = bad[j], bad[i]
    with pytest.raises(ValueError, match=r"F\[s1,m0\].*before its dependency F\[s0,m0\]"):
        Schedule.from_order(bad, 3, 3)


def test_backward_before_forward_rejected():
    order = [Action(0, 0, "B"), Action(0, 0, "F")]
    with pytest.raises(ValueError, match=r"B\[s0,m0\].*dependency F\[s0,m0\]"):
        Schedule.from_order(order, 1, 1)


def test_missing_and_duplicate_actions_rejected():
    order = GPipe(2, 2).order
    with pytest.raises(ValueError, match=r"missing.*B\[s1,m1\]"):
        Schedule.from_order([a for a in order if a != Action(1, 1, "B")], 2, 2)
    with pytest.raises(ValueError, match="more than once"):
        Schedule.from_order(order + [order[0]], 2, 2)
    with pytest.raises(ValueError, match="out of range"):
        Schedule.from_order(order + [Action(2, 0, "F")], 2, 2)
    with pytest.raises(ValueError, match="chunk 1 inconsistent"):
        Schedule.from_order([Action(0, 0, "F", 1)], 1, 1)


def test_deadlocking_per_stage_order_rejected():
    F, B = "F", "B"
    per = {  # 1F1B on 2 stages, 2 microbatches
        0: [Action(0, 0, F), Action(0, 1, F), Action(0, 0, B), Action(0, 1, B)],
        1: [Action(1, 0, F), Action(1, 0, B), Action(1, 1, F), Action(1, 1, B)],
    }
    ok = Schedule.from_per_stage_order(per, 2, 2)
    assert ok.per_stage_order == per
    assert ok.order == OneFOneB(2, 2).order
    # stage 0 wants B0 (needs stage 1's B0) before F1; stage 1 wants F1 before B0: a cycle
    per_bad = {
        0: [Action(0, 0, F), Action(0, 0, B), Action(0, 1, F), Action(0, 1, B)],
        1: [Action(1, 0, F), Action(1, 1, F), Action(1, 0, B), Action(1, 1, B)],
    }
    with pytest.raises(ValueError, match="deadlock"):
        Schedule.from_per_stage_order(per_bad, 2, 2)
    with pytest.raises(ValueError, match="listed for stage 0"):
        Schedule.from_per_stage_order({0: [Action(1, 0, "F")]}, 2, 1)


def test_action_validation():
    with pytest.raises(ValueError, match="'F', 'B' or 'W'"):
        Action(0, 0, "X")  # type: ignore[arg-type]
    assert Action(2, 3, "W").label == "W3" and str(Action(2, 3, "W")) == "W[s2,m3]"
    with pytest.raises(ValueError, match="non-negative"):
        Action(-1, 0, "F")
    assert str(Action(5, 3, "B", 1)) == "B[s5,m3,c1]"
    assert Action(5, 3, "B", 1).label == "B3.1"


def test_schedule_is_immutable_from_outside():
    s = OneFOneB(2, 2)
    before = s.order
    s.order.clear()
    s.per_stage_order[0].clear()
    assert s.order == before
    assert len(s.per_stage_order[0]) == 4


# --------------------------------------------------------------- factory


@pytest.mark.parametrize(
    "name,cls",
    [
        ("gpipe", GPipe),
        ("GPipe", GPipe),
        ("1f1b", OneFOneB),
        ("1F1B", OneFOneB),
        ("interleaved", Interleaved1F1B),
        ("Interleaved_1F1B", Interleaved1F1B),
        ("interleaved-1f1b", Interleaved1F1B),
    ],
)
def test_get_schedule_by_name(name, cls):
    s = get_schedule(name, 4, 8)
    assert type(s) is cls
    assert (s.num_stages, s.num_microbatches) == (4, 8)


def test_get_schedule_kwargs():
    s = get_schedule("interleaved", 2, 4, interleave=3)
    assert s.num_chunks == 3
    assert get_schedule("interleaved", 2, 4, num_chunks=4).num_chunks == 4
    assert get_schedule("gpipe", 2, 4, interleave=None).num_chunks == 1
    assert get_schedule("1f1b", 2, 4, interleave=1).num_chunks == 1
    assert get_schedule("1f1b", 2, 4, forward_only=True).forward_only
    with pytest.raises(ValueError, match="needs the 'interleaved' schedule"):
        get_schedule("1f1b", 2, 4, interleave=2)
    assert type(get_schedule(OneFOneB, 2, 4)) is OneFOneB


def test_get_schedule_unknown_name_lists_known():
    with pytest.raises(ValueError) as e:
        get_schedule("zigzag", 2, 2)
    msg = str(e.value)
    assert "zigzag" in msg
    for known in ("gpipe", "1f1b", "interleaved"):
        assert known in msg
    assert set(KNOWN_SCHEDULES) >= {"gpipe", "1f1b", "interleaved", "interleaved_1f1b"}
    with pytest.raises(ValueError, match="name"):
        get_schedule(3, 2, 2)  # type: ignore[arg-type]


def test_get_schedule_instance_checked():
    s = OneFOneB(4, 8)
    assert get_schedule(s, 4, 8) is s
    with pytest.raises(ValueError) as e:
        get_schedule(s, 2, 8)
    assert "num_stages=4" in str(e.value) and "num_stages=2" in str(e.value)
    with pytest.raises(ValueError) as e:
        get_schedule(s, 4, 16)
    assert "num_microbatches=8" in str(e.value) and "num_microbatches=16" in str(e.value)
    with pytest.raises(ValueError, match="forward_only"):
        get_schedule(s, 4, 8, forward_only=True)


@pytest.mark.parametrize("S,M", [(0, 4), (4, 0), (-1, 2), (2, -3), (True, 2), (2.0, 2)])
def test_invalid_counts(S, M):
    with pytest.raises(ValueError, match="positive int"):
        get_schedule("1f1b", S, M)
    with pytest.raises(ValueError, match="positive int"):
        GPipe(S, M)
    with pytest.raises(ValueError, match="positive int"):
        Interleaved1F1B(S, M, 2)


def test_invalid_chunks():
    with pytest.raises(ValueError, match="num_chunks"):
        Interleaved1F1B(2, 2, 0)


# --------------------------------------------------------------- display


def test_render_and_repr():
    s = OneFOneB(3, 4)
    text = s.render()
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("stage 0 |")
    assert lines[2].split("|")[1].split() == [
        ".", ".", "F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", ".", ".",
    ]
    for line in lines:
        cells = line.split("|")[1].split()
        assert sorted(c for c in cells if c != ".") == sorted(
            [f"F{m}" for m in range(4)] + [f"B{m}" for m in range(4)]
        )
    wide = s.render(backward_slots=2).splitlines()[2].split("|")[1].split()
    assert wide.count("B0") == 2
    r = repr(s)
    assert r.startswith("OneFOneB(") and "num_stages=3" in r and "num_microbatches=4" in r
    assert "bubble_fraction=0.333" in r and "peak_live_activations={0: 3, 1: 2, 2: 1}" in r
    assert str(s) == r + "\n" + text
    i = Interleaved1F1B(2, 2, 2)
    assert "num_chunks=2" in repr(i) and "F1.1" in i.render()
    assert "name='x'" in repr(Schedule.from_order(s.order, 3, 4, name="x"))
    with pytest.raises(ValueError):
        s.render(backward_slots=0)


@pytest.mark.parametrize("module", ["multimesh.schedules", "multimesh.schedules.builtin"])
def test_docstring_examples(module):
    """The package's worked example and the zero-bubble schedules' examples run as written."""
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0


# --------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(
    S=st.integers(1, 8),
    M=st.integers(1, 12),
    which=st.sampled_from(["gpipe", "1f1b", "interleaved"]),
    V=st.integers(1, 3),
    forward_only=st.booleans(),
)
def test_property_random_sizes(S, M, which, V, forward_only):
    if which == "interleaved":
        M = S * max(1, M // S)  # the interleaved schedule needs M % S == 0
        s = get_schedule(which, S, M, interleave=V, forward_only=forward_only)
    else:
        s = get_schedule(which, S, M, forward_only=forward_only)
        V = 1
    check_invariants(s)
    peaks = s.peak_live_activations
    if forward_only:
        assert set(peaks.values()) == {0}
    else:
        assert all(1 <= peaks[p] <= M * V for p in range(S))
        if which == "1f1b":
            assert peaks == {p: min(S - p, M) for p in range(S)}
        if which == "gpipe":
            assert peaks == {p: M for p in range(S)}
    assert s.bubble(1.0, 1.0) == pytest.approx(closed_form(S, M, V))


@settings(max_examples=60, deadline=None)
@given(S=st.integers(1, 5), M=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_property_random_topological_orders(S, M, seed):
    """Any random topological order is accepted; a dependency swap is rejected."""
    rng = random.Random(seed)
    probe = GPipe(S, M)
    remaining = set(probe.expected_actions())
    done: set[Action] = set()
    order: list[Action] = []
    while remaining:
        ready = sorted(a for a in remaining if all(d in done for d in probe.dependencies(a)))
        a = rng.choice(ready)
        order.append(a)
        done.add(a)
        remaining.remove(a)
    s = Schedule.from_order(order, S, M)
    check_invariants(s)
    # move a random action with dependencies to the front: now invalid
    with_deps = [a for a in order if probe.dependencies(a)]
    victim = rng.choice(with_deps)
    broken = [victim] + [a for a in order if a != victim]
    with pytest.raises(ValueError, match="before its dependency"):
        Schedule.from_order(broken, S, M)


# ------------------------------------------------------- zero-bubble schedules

ZB = [ZeroBubbleH1, ZeroBubbleH2]


def h1_bubble(S: int, M: int) -> float:
    """ZB-H1, default costs (F = B = W = 1): each stage idles (S-1)(F+B)."""
    return 2 * (S - 1) / (3 * M + 2 * (S - 1))


def h2_bubble(S: int, M: int) -> float:
    """ZB-H2, default costs, M >= S: each stage idles S-1 forward times."""
    return (S - 1) / (3 * M + S - 1)


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 12])
@pytest.mark.parametrize("S", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("cls", ZB)
def test_zero_bubble_valid_and_complete(cls, S, M, forward_only):
    s = cls(S, M, forward_only=forward_only)
    check_invariants(s)  # counts F/B/W, dependencies in order and per stage, simulation
    assert s.split_backward is (not forward_only)
    kinds = Counter(a.kind for a in s.order)
    if forward_only:
        assert kinds == Counter({"F": S * M})
        return
    assert kinds == Counter({"F": S * M, "B": S * M, "W": S * M})
    for p, acts in s.per_stage_order.items():
        for kind in "FBW":
            # every kind runs in microbatch order on each stage
            assert [a.microbatch for a in acts if a.kind == kind] == list(range(M))
        pos = {a: i for i, a in enumerate(acts)}
        for m in range(M):
            assert pos[Action(p, m, "F")] < pos[Action(p, m, "B")] < pos[Action(p, m, "W")]


def test_non_split_schedules_have_no_w():
    for s in all_schedules(4, 8) + all_schedules(3, 5):
        assert s.split_backward is False
        assert not any(a.kind == "W" for a in s.order)
        assert all(a.kind in "FB" for a in s.expected_actions())
        b = s.action(0, 0, "B")
        assert s.dependencies(b)[0] == s.action(0, 0, "F")


def test_w_dependencies():
    s = ZeroBubbleH1(3, 4)
    assert s.dependencies(s.action(1, 2, "W")) == (Action(1, 2, "B"),)
    assert s.dependencies(s.action(1, 2, "B")) == (Action(1, 2, "F"), Action(2, 2, "B"))
    assert s.dependencies(s.action(2, 2, "B")) == (Action(2, 2, "F"),)
    assert s.action(1, 2, "W") == Action(1, 2, "W", 0)
    expected = s.expected_actions()
    assert len(expected) == 3 * 3 * 4 and Action(2, 3, "W") in expected
    tl = s.simulate()
    for a in s.order:
        if a.kind == "W":
            assert tl.start(a) >= tl.end(Action(a.stage, a.microbatch, "B"))


@pytest.mark.parametrize("S", [1, 2, 3, 4, 5, 6])
def test_zb_h1_peak_and_warmup_equal_1f1b(S):
    for M in range(1, 4 * S + 1):
        z, ref = ZeroBubbleH1(S, M), OneFOneB(S, M)
        assert z.peak_live_activations == {p: min(S - p, M) for p in range(S)}
        assert z.peak_live_activations == ref.peak_live_activations
        for p, acts in z.per_stage_order.items():  # 1F1B's warm-up: min(S-p, M) F before the first B
            first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
            assert first_b == min(S - p, M)
            assert all(a.kind == "F" for a in acts[:first_b])


@pytest.mark.parametrize("S", [2, 3, 4, 5])
def test_zb_h1_bubble_below_1f1b(S):
    for M in range(S, 4 * S + 1):
        z, ref = ZeroBubbleH1(S, M), OneFOneB(S, M)
        assert z.bubble_fraction < ref.bubble_fraction, (S, M)
        assert z.bubble_fraction == pytest.approx(h1_bubble(S, M))
        assert z.simulate().makespan == pytest.approx(3 * M + 2 * (S - 1))
        assert ref.bubble_fraction == pytest.approx(closed_form(S, M))


@pytest.mark.parametrize("S", [1, 2, 3, 4, 5])
def test_zb_h1_few_microbatches_still_valid(S):
    for M in range(1, S + 1):
        z = ZeroBubbleH1(S, M)
        check_invariants(z)
        assert z.bubble_fraction == pytest.approx(h1_bubble(S, M))
        assert z.bubble_fraction <= OneFOneB(S, M).bubble_fraction


@pytest.mark.parametrize("S", [1, 2, 3, 4, 5, 6])
def test_zb_h2_peak_warmup_and_bubble(S):
    for M in range(1, 4 * S + 1):
        h2, h1 = ZeroBubbleH2(S, M), ZeroBubbleH1(S, M)
        assert h2.peak_live_activations == {p: min(2 * S - 1 - p, M) for p in range(S)}
        for p, acts in h2.per_stage_order.items():
            first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
            assert first_b == min(2 * (S - p) - 1, M)
        assert h2.bubble_fraction <= h1.bubble_fraction + 1e-12, (S, M)
        if M >= S:
            assert h2.bubble_fraction == pytest.approx(h2_bubble(S, M))
            # the last stage cannot start before S-1 forwards: nothing can do better
            assert h2.simulate().makespan == pytest.approx(3 * M + S - 1)
            if S >= 2:
                assert h2.bubble_fraction < h1.bubble_fraction


def test_measured_bubbles_table():
    got = {
        (S, M): tuple(round(c(S, M).bubble_fraction, 4) for c in (OneFOneB, ZeroBubbleH1, ZeroBubbleH2))
        for S in (2, 4)
        for M in (4, 8)
    }
    assert got == {
        (2, 4): (0.2, 0.1429, 0.0769),
        (2, 8): (0.1111, 0.0769, 0.04),
        (4, 4): (0.4286, 0.3333, 0.2),
        (4, 8): (0.2727, 0.2, 0.1111),
    }


def test_split_time_model():
    s = ZeroBubbleH1(3, 4)
    tl = s.simulate(1.0, 3.0)
    for a in s.order:
        want = {"F": 1.0, "B": 1.5, "W": 1.5}[a.kind]
        assert tl.end(a) - tl.start(a) == pytest.approx(want)
    assert all(b == pytest.approx(4 * (1.0 + 3.0)) for b in tl.busy.values())
    default = s.simulate()
    assert {tl_end - tl_start for tl_start, tl_end in default.spans.values()} == {1.0}
    assert s.bubble_fraction == pytest.approx(s.bubble(1.0, 2.0))
    assert s.bubble(comm_time=0.5) > s.bubble()
    with pytest.raises(ValueError, match="positive"):
        s.simulate(backward_time=0.0)


def test_peak_counts_until_w():
    S, M = 3, 4
    one = OneFOneB(S, M).per_stage_order
    # W right after its B: live until W equals 1F1B's live until B
    w_after_b = {p: [x for a in acts for x in ([a, Action(p, a.microbatch, "W")] if a.kind == "B" else [a])]
                 for p, acts in one.items()}
    s = Schedule.from_per_stage_order(w_after_b, S, M)
    assert s.split_backward
    assert s.peak_live_activations == {p: min(S - p, M) for p in range(S)}
    # every W deferred to the end of its stage: everything stays live
    w_last = {p: acts + [Action(p, m, "W") for m in range(M)] for p, acts in one.items()}
    late = Schedule.from_per_stage_order(w_last, S, M)
    check_invariants(late)
    assert late.peak_live_activations == {p: M for p in range(S)}
    assert OneFOneB(S, M).peak_live_activations == {p: min(S - p, M) for p in range(S)}


def test_from_order_split_inference_and_keyword():
    z = ZeroBubbleH1(3, 4)
    copy = Schedule.from_order(z.order, 3, 4, name="zcopy")
    assert copy.split_backward and copy == z and hash(copy) == hash(z)
    assert copy.peak_live_activations == z.peak_live_activations
    assert "split_backward=True" in repr(copy)
    assert Schedule.from_order(z.order, 3, 4, split_backward=True) == z
    per = Schedule.from_per_stage_order(z.per_stage_order, 3, 4)
    assert per.split_backward and per.order == z.order
    plain = Schedule.from_order(OneFOneB(3, 4).order, 3, 4)
    assert not plain.split_backward and plain == OneFOneB(3, 4) and plain != z
    assert "split_backward" not in repr(plain)


def test_w_in_non_split_schedule_rejected():
    order = OneFOneB(2, 2).order
    with_w = order + [Action(s, m, "W") for s in range(2) for m in range(2)]
    # all W present: a valid split schedule when inferred, an error when split is refused
    assert Schedule.from_order(with_w, 2, 2).split_backward
    with pytest.raises(ValueError, match=r"W\[s0,m0\].*split_backward=False"):
        Schedule.from_order(with_w, 2, 2, split_backward=False)
    with pytest.raises(ValueError, match=r"weight-gradient \(W\) action.*split_backward=False"):
        Schedule.from_order(ZeroBubbleH1(2, 2).order, 2, 2, split_backward=False)
    per = {p: acts + [Action(p, 0, "W")] for p, acts in OneFOneB(2, 2).per_stage_order.items()}
    with pytest.raises(ValueError, match="split_backward=False"):
        Schedule.from_per_stage_order(per, 2, 2, split_backward=False)
    with pytest.raises(ValueError, match="forward-only"):
        Schedule.from_order([Action(0, 0, "F"), Action(0, 0, "W")], 1, 1, forward_only=True)


def test_missing_w_in_split_schedule_rejected():
    order = OneFOneB(2, 2).order
    one_w = order + [Action(1, 0, "W")]  # inferred split: the other three W are missing
    with pytest.raises(ValueError, match=r"missing.*W\[s0,m0\].*W after every B"):
        Schedule.from_order(one_w, 2, 2)
    with pytest.raises(ValueError, match=r"missing.*W\[s0,m0\].*W after every B"):
        Schedule.from_order(order, 2, 2, split_backward=True)
    z = ZeroBubbleH1(2, 3).order
    with pytest.raises(ValueError, match=r"missing from schedule: W\[s1,m2\]"):
        Schedule.from_order([a for a in z if a != Action(1, 2, "W")], 2, 3)
    with pytest.raises(ValueError, match="more than once"):
        Schedule.from_order(z + [Action(1, 2, "W")], 2, 3)


def test_w_before_its_b_rejected():
    z = ZeroBubbleH1(2, 2).order
    w, b = Action(0, 1, "W"), Action(0, 1, "B")
    bad = [a for a in z if a != w]
    bad.insert(bad.index(b), w)
    with pytest.raises(ValueError, match=r"W\[s0,m1\].*before its dependency B\[s0,m1\]"):
        Schedule.from_order(bad, 2, 2)
    per = ZeroBubbleH1(2, 2).per_stage_order
    per[0] = [a for a in per[0] if a != w]
    per[0].insert(per[0].index(b), w)
    with pytest.raises(ValueError, match="deadlock"):
        Schedule.from_per_stage_order(per, 2, 2)


@pytest.mark.parametrize(
    "name,cls",
    [
        ("zb-h1", ZeroBubbleH1),
        ("ZB-H1", ZeroBubbleH1),
        ("zb_h1", ZeroBubbleH1),
        ("zero-bubble", ZeroBubbleH1),
        ("zero-bubble-h1", ZeroBubbleH1),
        ("zbh1", ZeroBubbleH1),
        ("Zero Bubble H1", ZeroBubbleH1),
        ("zb-h2", ZeroBubbleH2),
        ("zero-bubble-h2", ZeroBubbleH2),
        ("ZERO_BUBBLE_H2", ZeroBubbleH2),
    ],
)
def test_get_zero_bubble_by_name(name, cls):
    s = get_schedule(name, 4, 8)
    assert type(s) is cls and s.split_backward
    assert (s.num_stages, s.num_microbatches) == (4, 8)
    assert get_schedule(name, 4, 8, forward_only=True) == OneFOneB(4, 8, forward_only=True)


def test_zero_bubble_names_known():
    assert ZeroBubbleH1.name == "zb-h1" and ZeroBubbleH2.name == "zb-h2"
    assert {"zb-h1", "zb-h2", "zero-bubble", "zero-bubble-h1", "zbh1", "zero-bubble-h2"} <= set(
        KNOWN_SCHEDULES
    )
    for known in KNOWN_SCHEDULES:  # every advertised name resolves
        get_schedule(known, 2, 2)
    with pytest.raises(ValueError) as e:
        get_schedule("zb-h3", 2, 2)
    assert "zb-h1" in str(e.value) and "zero-bubble-h2" in str(e.value)
    with pytest.raises(ValueError, match="needs the 'interleaved' schedule"):
        get_schedule("zb-h1", 2, 4, interleave=2)
    assert get_schedule("zb-h2", 2, 4, interleave=1).num_chunks == 1
    z = ZeroBubbleH1(2, 4)
    assert get_schedule(z, 2, 4, split_backward=True) is z
    assert type(get_schedule(ZeroBubbleH2, 2, 4)) is ZeroBubbleH2


def test_zero_bubble_forward_only_is_1f1b():
    for S, M in [(1, 3), (2, 4), (4, 8), (5, 3)]:
        ref = OneFOneB(S, M, forward_only=True)
        for cls in ZB:
            s = cls(S, M, forward_only=True)
            assert s.forward_only and not s.split_backward
            assert s == ref and s.order == ref.order and s.per_stage_order == ref.per_stage_order
            assert all(a.kind == "F" for a in s.order)
            assert s.peak_live_activations == {p: 0 for p in range(S)}
            assert s.bubble_fraction == pytest.approx(ref.bubble_fraction)
            assert s.render() == ref.render()


def test_zero_bubble_render():
    s = ZeroBubbleH1(3, 4)
    lines = s.render().splitlines()
    assert len(lines) == 3
    assert lines[2].split("|")[1].split() == [
        ".", ".", "F0", "B0", "W0", "F1", "B1", "W1", "F2", "B2", "W2", "F3", "B3", "W3", ".", ".",
    ]
    for line in lines:
        cells = line.split("|")[1].split()
        assert len(cells) <= 3 * 4 + 2 * (3 - 1)
        assert sorted(c for c in cells if c != ".") == sorted(f"{k}{m}" for k in "FBW" for m in range(4))
    wide = s.render(backward_slots=2).splitlines()[0].split("|")[1].split()
    assert wide.count("W0") == 2 and wide.count("B0") == 2 and wide.count("F0") == 1
    assert "W" in str(ZeroBubbleH2(2, 3))
    assert repr(s).startswith("ZeroBubbleH1(") and "peak_live_activations={0: 3, 1: 2, 2: 1}" in repr(s)
    assert "zb-h1" in sched_mod.__doc__ and "W0" in sched_mod.__doc__


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 8), M=st.integers(1, 16))
def test_property_zero_bubble_random_sizes(S, M):
    h1, h2, ref = ZeroBubbleH1(S, M), ZeroBubbleH2(S, M), OneFOneB(S, M)
    check_invariants(h1)
    check_invariants(h2)
    assert h1.peak_live_activations == ref.peak_live_activations
    assert h2.peak_live_activations == {p: min(2 * S - 1 - p, M) for p in range(S)}
    assert h1.bubble_fraction == pytest.approx(h1_bubble(S, M))
    assert h2.bubble_fraction <= h1.bubble_fraction + 1e-12
    if S >= 2:
        assert h1.bubble_fraction < ref.bubble_fraction


def test_microbatch_docstring_lists_every_schedule_it_accepts():
    from multimesh.jax import microbatch

    doc = microbatch.__doc__
    missing = [name for name in KNOWN_SCHEDULES if f'``"{name}"``' not in doc]
    assert not missing, f"microbatch's docstring does not list {missing}"
