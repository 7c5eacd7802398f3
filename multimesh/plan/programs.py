"""Identical segments share one program: a pipeline compiles per (stage, pass), not per microbatch.

An unrolled microbatch loop gives each (stage, pass) one segment per
microbatch. They are the same computation on the same submesh, except for
scalar literals such as the offset at which a microbatch is sliced out of the
batch. `group_programs` keys every segment by its structure (primitives,
parameters, shapes, wiring; literal *values* left out) and groups equal
keys; a literal whose value differs inside a group becomes an argument of the
group's program. Each group is then one `jax.jit`, compiled once and called
for every microbatch: the number of executables depends on the stages and the
step, not on the number of microbatches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from ..trace.interpret import bind_equation, interpret
from ..trace.task import Placement
from .segment import Segment

__all__ = ["Program", "group_programs", "run_program"]

# Parameters that only differentiation reads: the trace is final, lowering ignores them.
_AD_ONLY = {
    "custom_jvp_call": ("jvp_jaxpr_fun", "jvp_jaxpr_thunk"),
    "custom_vjp_call": ("fwd_jaxpr_thunk", "bwd", "out_trees"),
}


@dataclass
class Program:
    """One executable's worth of segments: same structure, same placement, same donation.

    ``jaxpr`` is the first segment's; ``lifted`` lists the literal operands
    (equation index, operand index) passed as arguments, and ``literals``
    their values per segment (in ``segments`` order).
    """

    index: int
    placement: Placement
    jaxpr: ClosedJaxpr
    donate: tuple[int, ...]
    segments: list[int]
    lifted: tuple[tuple[int, int], ...]
    literals: list[tuple[Any, ...]]

    def literal_values(self, segment: int) -> tuple[Any, ...]:
        """The lifted literals' values (numpy scalars of their dtypes) for ``segment``."""
        return self.literals[self.segments.index(segment)]


def _param_key(primitive: str, params: dict) -> tuple:
    skip = _AD_ONLY.get(primitive, ())
    out = []
    for k in sorted(params):
        if k in skip:
            continue
        v = params[k]
        if isinstance(v, (Jaxpr, ClosedJaxpr)):
            v = str(v)  # printed with canonical variable names: equal programs print equally
        else:
            try:
                hash(v)
            except TypeError:
                v = repr(v)
        out.append((k, v))
    return tuple(out)


def _structure(eqns: Sequence[JaxprEqn], invars: Sequence[Var], outvars: Sequence[Var],
               param_keys: dict[int, tuple]) -> tuple[tuple, list]:
    """(a hashable key of the segment's computation without literal values, the literal values in order).

    ``param_keys``: each parameter dict's key by its id, kept across segments: a body called once per
    microbatch is copied with the same parameters, so each is keyed (nested jaxprs printed) once."""
    number: dict[Var, int] = {v: i for i, v in enumerate(invars)}
    key: list = [tuple(v.aval for v in invars)]
    literals: list = []
    for e in eqns:
        ins: list[tuple[str, Any] | int] = []  # a literal's aval, or the number of the value it reads
        for x in e.invars:
            if isinstance(x, Literal):
                ins.append(("literal", x.aval))
                literals.append(x.val)
            else:
                ins.append(number[x])
        for v in e.outvars:
            number[v] = len(number)
        params = param_keys.get(id(e.params))
        if params is None:
            params = param_keys[id(e.params)] = _param_key(e.primitive.name, e.params)
        key.append((e.primitive.name, params, tuple(ins), tuple(v.aval for v in e.outvars)))
    key.append(tuple(number[v] for v in outvars))
    return tuple(key), literals


def _same(a: Any, b: Any) -> bool:
    return np.asarray(a).dtype == np.asarray(b).dtype and bool(np.array_equal(a, b))


def group_programs(segments: Sequence[Segment], donate: dict[int, tuple[int, ...]]) -> list[Program]:
    """Group ``segments`` into programs (see the module docstring)."""
    groups: dict[tuple, list[tuple[Segment, list]]] = {}
    param_keys: dict[int, tuple] = {}  # the equations, hence their parameter dicts, outlive this loop
    for seg in segments:
        key, literals = _structure(seg.eqns, seg.invars, seg.outvars, param_keys)
        groups.setdefault((seg.placement, donate.get(seg.index, ()), key), []).append((seg, literals))
    programs: list[Program] = []
    for (placement, donation, _), members in groups.items():
        first, values = members[0]
        varying = [i for i, v in enumerate(values) if any(not _same(v, other[i]) for _, other in members[1:])]
        positions = [(k, j) for k, e in enumerate(first.eqns) for j, x in enumerate(e.invars) if isinstance(x, Literal)]
        programs.append(Program(
            index=len(programs), placement=placement, jaxpr=first.closed_jaxpr(), donate=donation,
            segments=[s.index for s, _ in members], lifted=tuple(positions[i] for i in varying),
            literals=[tuple(np.asarray(vals[i], dtype=first.eqns[positions[i][0]].invars[positions[i][1]].aval.dtype)
                            for i in varying) for _, vals in members],
        ))
    return programs


def run_program(program: Program, rule: Callable[[JaxprEqn, list], Sequence[Any]] = bind_equation) -> Callable:
    """``f(*inputs, *lifted_literals)`` evaluating the program's jaxpr (to be wrapped in `jax.jit`)."""
    jaxpr = program.jaxpr.jaxpr
    n_in = len(jaxpr.invars)
    slots: dict[int, dict[int, int]] = {}
    for arg, (k, j) in enumerate(program.lifted):
        slots.setdefault(id(jaxpr.eqns[k]), {})[j] = n_in + arg

    def run(*args: Any) -> list:
        def with_literals(eqn: JaxprEqn, ins: list) -> Sequence[Any]:
            for j, a in slots.get(id(eqn), {}).items():
                ins[j] = args[a]
            return rule(eqn, ins)

        return interpret(jaxpr, program.jaxpr.consts, args[:n_in], with_literals)

    return run
