"""Collectives read from a compiled program's HLO text: kind, bytes, group size, and the mesh axes they run over.

Each collective instruction (``all-reduce``, ``all-gather``, ``reduce-scatter``,
``all-to-all``, ``collective-permute``; an asynchronous ``-start``/``-done``
pair counts once, with the ``-done``'s shape) is one `Collective`. Its bytes
are those of its result on one device (an all-gather's gathered array, a
reduce-scatter's scattered piece). Its ``count`` is how often one run of
the program executes it: 1, or for an instruction inside a loop body (a
``scan``), the loop's trip count where XLA knows it (``known_trip_count``),
times that of every loop around it; a branch of a conditional counts as if
taken.

Device groups are read in the three forms XLA prints (explicit
``{{0,1},{2,3}}``, iota ``[2,4]<=[4,2]T(1,0)``, and mesh axes
``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``). The ids in them are positions in
the program's device assignment, which for a program on one mesh is the mesh's
devices in order; the groups are matched against the mesh's axes, and a
collective whose groups match no set of axes has axes ``None`` (shown as
"unknown axes").
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["KINDS", "Collective", "find_collectives", "shape_bytes"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
                          r"(?P<kind>" + "|".join(KINDS) + r")(?P<phase>-start|-done)?\((?P<rest>.*)$")


@dataclass(frozen=True)
class Collective:
    """One collective instruction: ``bytes`` of its result per device, ``group_size`` devices per group,
    ``axes`` the mesh axes its groups span (None: not matched to mesh axes), ``count`` its executions."""

    kind: str
    bytes: int
    group_size: int
    axes: tuple[str, ...] | None
    name: str
    #: executions per run of its program (a loop body's: the trip count)
    count: int = 1

    @property
    def axes_label(self) -> str:
        if self.axes is None:
            return "unknown axes"
        return ",".join(self.axes) if self.axes else "-"


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (``f32[16,8]{1,0}`` or a tuple of them); 8-bit float types count 1 byte."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]", shape):
        size = _ITEMSIZE.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is None:
            continue  # token[] and the like carry no data
        total += int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * size
    return total


def _braced(text: str, start: int) -> str:
    """The ``{...}`` group starting at ``text[start]``, nested braces included."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i + 1]
    return text[start:]


def _groups(rest: str, n_devices: int) -> list[list[int]] | None:
    """The device groups of an instruction's attributes, or None when absent or unreadable."""
    at = rest.find("replica_groups=")
    if at < 0:
        return None
    text = rest[at + len("replica_groups="):]
    if text.startswith("{"):
        body = _braced(text, 0)
        groups = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1])]
        return groups if groups and any(groups) else [list(range(n_devices))]
    iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:
        shape = [int(x) for x in iota.group(1).split(",")]
        dims = [int(x) for x in iota.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()
    mesh = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
    if mesh:
        dims = re.findall(r"'([^']+)'\s*=\s*(\d+)", mesh.group(1))
        if not dims or ":" in mesh.group(2):  # sub-axes: not read
            return None
        names = [d for d, _ in dims]
        sizes = [int(s) for _, s in dims]
        over = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(2)) if a in names]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        rest_axes = [i for i in range(len(sizes)) if i not in over]
        ids = ids.transpose(rest_axes + over).reshape(-1, int(np.prod([sizes[i] for i in over], dtype=np.int64)))
        return ids.tolist()
    return None


def _pairs(rest: str) -> list[list[int]] | None:
    at = rest.find("source_target_pairs=")
    if at < 0:
        return None
    body = _braced(rest, at + len("source_target_pairs="))
    return [[int(x) for x in p.split(",")] for p in re.findall(r"\{(\d+,\d+)\}", body)]


def _axes_of_groups(groups: Sequence[Sequence[int]], names: Sequence[str], sizes: Sequence[int]) -> tuple | None:
    """The set of mesh axes whose variation makes exactly these groups, or None."""
    n = int(np.prod(sizes, dtype=np.int64))
    if any(i >= n for g in groups for i in g):
        return None
    coords = np.array(np.unravel_index(np.arange(n), sizes)).T
    want = {frozenset(g) for g in groups}
    for k in range(len(names) + 1):
        for over in itertools.combinations(range(len(names)), k):
            fixed = [i for i in range(len(names)) if i not in over]
            made: dict[tuple, set] = {}
            for p in range(n):
                made.setdefault(tuple(coords[p][fixed]), set()).add(p)
            if {frozenset(g) for g in made.values()} == want:
                return tuple(names[i] for i in over if sizes[i] > 1)
    return None


def _axes_of_pairs(pairs: Sequence[Sequence[int]], names: Sequence[str], sizes: Sequence[int]) -> tuple | None:
    """The mesh axes along which a permutation's sources and targets differ."""
    n = int(np.prod(sizes, dtype=np.int64))
    if any(i >= n for p in pairs for i in p):
        return None
    differ = set()
    for s, t in pairs:
        cs, ct = np.unravel_index(s, sizes), np.unravel_index(t, sizes)
        differ |= {i for i in range(len(names)) if cs[i] != ct[i]}
    return tuple(names[i] for i in sorted(differ))


_COMPUTATION = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\{\s*$")
_CALLED = re.compile(r"\b(?:to_apply|calls|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


def _runs(calls: dict[str, list[tuple[str, int]]], entry: str | None) -> dict[str, int]:
    """Computation -> how often one run of ``entry`` runs it, along every chain of calls (a DAG)."""
    if entry is None:
        return {}
    runs: dict[str, int] = {}
    order: list[str] = []  # each computation after every one it calls (walked in reverse: callers first)
    seen: set[str] = set()

    def visit(name: str) -> None:
        seen.add(name)
        for callee, _ in calls.get(name, ()):
            if callee not in seen:
                visit(callee)
        order.append(name)

    visit(entry)
    runs[entry] = 1
    for name in reversed(order):
        for callee, times in calls.get(name, ()):
            runs[callee] = runs.get(callee, 0) + runs.get(name, 0) * times
    return runs


def find_collectives(hlo_text: str, axis_names: Sequence[str], axis_sizes: Sequence[int]) -> list[Collective]:
    """Every collective of a compiled program's HLO (``compiled.as_text()``), in text order."""
    n_devices = int(np.prod(axis_sizes, dtype=np.int64))
    started: dict[str, tuple[str, str]] = {}  # name of a -start -> (kind, its attributes)
    out = []
    where: list[str | None] = []  # the computation of each collective found
    calls: dict[str, list[tuple[str, int]]] = {}  # computation -> (computation it calls, times per run)
    current, entry = None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line) if " = " not in line else None
        if header is not None:
            current = header.group("name")
            entry = current if header.group("entry") else entry
            continue
        if current is not None and " = " in line:
            edges = calls.setdefault(current, [])
            body = _BODY.search(line)
            if body is not None:
                trips = _TRIPS.search(line)
                edges.append((body.group(1), int(trips.group(1)) if trips else 1))
            edges.extend((c, 1) for c in _CALLED.findall(line))
            branches = _BRANCHES.search(line)
            if branches is not None:
                edges.extend((c.strip().lstrip("%"), 1) for c in branches.group(1).split(",") if c.strip())
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        kind, phase, rest = m.group("kind"), m.group("phase"), m.group("rest")
        if phase == "-start":
            started[m.group("name")] = (kind, rest)
            continue
        if phase == "-done":
            operand = re.match(r"\s*%?([\w.\-]+)", rest)
            kind, rest = started.pop(operand.group(1), (kind, rest)) if operand else (kind, rest)
        if kind == "collective-permute":
            pairs = _pairs(rest) or []
            axes = _axes_of_pairs(pairs, axis_names, axis_sizes)
            size = 2
        else:
            groups = _groups(rest, n_devices)
            if groups is None:
                groups = [list(range(n_devices))]
            axes = _axes_of_groups(groups, axis_names, axis_sizes)
            size = max(len(g) for g in groups)
        out.append(Collective(kind, shape_bytes(m.group("shape")), size, axes, m.group("name")))
        where.append(current)
    runs = _runs(calls, entry)
    return [dataclasses.replace(c, count=runs.get(w, 1)) if runs.get(w, 1) != 1 else c for c, w in zip(out, where)]
