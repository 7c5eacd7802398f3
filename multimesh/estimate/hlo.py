"""A compiled program's HLO text read as computations of instructions, and how often one run executes each.

``compiled.as_text()`` prints computations (``%name (params) -> shape {``,
the entry marked ``ENTRY``) of instruction lines
(``%x = f32[8,16]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused``).
`parse_module` keeps each instruction's name, result shape, opcode, operand
names and the attributes after them, and every call between computations
with how it calls (a loop ``body`` with its ``known_trip_count``, a
``condition``, a conditional's ``branch``, a ``call``, a ``fusion``'s fused
computation, a reducer ``applied`` to elements). `Module.runs` follows some
of those calls from the entry: how often one run of the program runs each
computation, a loop body as often as its trip count (1 where XLA does not
know it), times every loop around it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass

__all__ = ["CALLS", "Instruction", "Module", "calls_of", "parse_module", "shape_bytes"]

#: How a computation may be called: everything but ``fused`` and ``applied`` runs as code of its own.
CALLS = ("body", "condition", "branch", "call", "fused", "applied")

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_COMPUTATION = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
                          r"(?P<opcode>[a-z][\w\-]*)\((?P<tail>.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_CALLEE = {  # attribute -> how it calls
    "body": "body", "condition": "condition", "true_computation": "branch", "false_computation": "branch",
    "to_apply": "applied", "calls": "fused",
}
_CALLEE_RE = re.compile(r"\b(" + "|".join(_CALLEE) + r")=%?([\w.\-]+)")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (``f32[16,8]{1,0}`` or a tuple of them); 8-bit float types count 1 byte."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]", shape):
        size = _ITEMSIZE.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is None:
            continue  # token[] and the like carry no data
        total += math.prod(int(d) for d in dims.split(",") if d) * size
    return total


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction: ``shape`` its result's shape text, ``operands`` the names it reads, ``literal`` the
    text between its parentheses (a parameter's number, a constant's value), ``attributes`` the text after."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    root: bool = False
    literal: str = ""


def _split_operands(tail: str) -> tuple[str, str]:
    """``a, b), attrs`` -> (``a, b``, ``, attrs``): the operand list up to its closing parenthesis."""
    end = tail.find(")")
    if end >= 0 and "(" not in tail[:end]:  # the usual case: no parentheses inside the list
        return tail[:end], tail[end + 1:]
    depth = 1
    for i, ch in enumerate(tail):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return tail[:i], tail[i + 1:]
    return tail, ""


def calls_of(ins: Instruction) -> list[tuple[str, str, int]]:
    """(callee, how, times per execution of ``ins``) for every computation ``ins`` calls."""
    out = []
    for attr, callee in _CALLEE_RE.findall(ins.attributes):
        how = _CALLEE[attr]
        if attr == "to_apply" and ins.opcode == "call":
            how = "call"
        elif attr == "calls" and ins.opcode != "fusion":
            how = "call"  # an async wrapper's computation (``async-start``), a custom call's: code of its own
        times = 1
        if how in ("body", "condition"):  # as often as the loop iterates (its condition once more)
            trips = _TRIPS.search(ins.attributes)
            times = int(trips.group(1)) if trips else 1
        out.append((callee, how, times))
    branches = _BRANCHES.search(ins.attributes)
    if branches is not None:
        out.extend((c.strip().lstrip("%"), "branch", 1) for c in branches.group(1).split(",") if c.strip())
    return out


class Module:
    """A parsed HLO module: its computations' instructions in text order, the entry's name, and per
    computation the calls it makes as (callee, how, times per run of the caller)."""

    def __init__(self, computations: dict[str, tuple[Instruction, ...]], entry: str | None,
                 calls: dict[str, tuple[tuple[str, str, int], ...]]):
        self.computations, self.entry, self.calls = computations, entry, calls
        self._by_name = {i.name: i for body in computations.values() for i in body}

    def instruction(self, name: str) -> Instruction | None:
        """The instruction named ``name`` (names are unique in a module), or None."""
        return self._by_name.get(name)

    def shape(self, name: str) -> str:
        """The result shape of instruction ``name`` ('' when no instruction has that name)."""
        ins = self._by_name.get(name)
        return ins.shape if ins is not None else ""

    def runs(self, follow: Collection[str] = CALLS) -> dict[str, int]:
        """Computation -> how often one run of the entry runs it, following the calls of the kinds in
        ``follow`` (a DAG: every chain of calls counts)."""
        if self.entry is None:
            return {}
        order: list[str] = []  # each computation after every one it calls (walked in reverse: callers first)
        seen: set[str] = set()

        def visit(name: str) -> None:
            seen.add(name)
            for callee, how, _ in self.calls.get(name, ()):
                if how in follow and callee not in seen:
                    visit(callee)
            order.append(name)

        visit(self.entry)
        runs = {self.entry: 1}
        for name in reversed(order):
            for callee, how, times in self.calls.get(name, ()):
                if how in follow:
                    runs[callee] = runs.get(callee, 0) + runs.get(name, 0) * times
        return runs

    def executed(self, follow: Collection[str] = CALLS) -> Iterator[tuple[Instruction, int]]:
        """Every instruction of the computations reached through ``follow``, with its runs per program run."""
        for name, times in self.runs(follow).items():
            for ins in self.computations.get(name, ()):
                yield ins, times


def parse_module(text: str | Module) -> Module:
    """Read ``compiled.as_text()`` (or any HLO module text); a `Module` is returned as it is."""
    if isinstance(text, Module):
        return text
    computations: dict[str, list[Instruction]] = {}
    calls: dict[str, list[tuple[str, str, int]]] = {}
    current, entry = None, None
    for line in text.splitlines():
        if " = " not in line:
            header = _COMPUTATION.match(line)
            if header is not None:
                current = header.group("name")
                computations[current] = []
                entry = current if header.group("entry") else entry
            continue
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        if current is None:  # instructions outside any computation (a fragment): kept under the name ""
            current = ""
            computations[current] = []
        operands, attributes = _split_operands(m.group("tail"))
        ins = Instruction(m.group("name"), m.group("shape"), m.group("opcode"), tuple(_OPERAND.findall(operands)),
                          attributes, root=line.lstrip().startswith("ROOT "), literal=operands.strip())
        computations[current].append(ins)
        calls.setdefault(current, []).extend(calls_of(ins))
    return Module({k: tuple(v) for k, v in computations.items()}, entry, {k: tuple(v) for k, v in calls.items()})
