"""Split one scanned layer stack (``nn.scan``, ``jax.lax.scan``) over several pipeline stages.

Production models stack their layers with a scan: one ``scan`` equation runs
every layer, and each parameter holds all layers along a *layer axis*
(``(L, ...)``). ``register_task(r"layers", split={(0, 2): stage0, (2, 4): stage1})``
asks for layers ``[0, 2)`` on one submesh and ``[2, 4)`` on another. This
module does it on the traced step, before partitioning (`partition.partition`):

1. **Find.** A ``scan`` equation is split when a ``split=`` registration
   matches one of its scope names: the equation's own (``jax.named_scope``
   around ``jax.lax.scan``) or the scope every equation of its body shares
   (Flax Linen runs the scanned module's body under its name, not the scan).
   The ranges must tile ``[0, length)``; the forward scan and its transpose
   (the backward, ``reverse=True``) of every microbatch are split alike.
2. **Propagate.** Which other values are better kept in parts: a value is
   *split along axis a* when it feeds or comes out of a split scan's stacked
   operands (``xs``/``ys``, axis 0), or is tied to such a value by an
   equation that can run part by part: elementwise arithmetic (the optimizer
   update, gradient accumulation), a logical sharding constraint (Flax
   constrains a boxed stack where the step unboxes it), ``transpose`` (a layer axis at dimension 1,
   MaxText's ``param_scan_axis=1``, is moved to 0 before scanning),
   ``broadcast_in_dim``, and reductions that keep the axis. Propagated to a
   fixed point, this reaches the step's inputs (the stacked parameters, the
   optimizer moments) and outputs (their new values).
3. **Rewrite.** The step is re-traced with every split value held as its
   parts: a split scan becomes consecutive scans over the parts (the carry
   flows from one to the next; backwards for a reverse scan), each under the
   scope ``name[first:stop]`` and placed on its part's submesh; per-part
   equations run once per part; a reduction over the split axis reduces each
   part and combines the results (``add``/``max``/``min``). Anything else
   that reads a split value gets it whole (a ``concatenate``, moved to where
   it runs), and a whole value that a part needs is sliced: correct, but a
   copy, so this happens only where the model leaves no choice.
4. **Boundary.** The rewritten step takes a split input as its parts and
   returns a split output as its parts (`Boundary`). Outside, the array is
   one `jax.Array` whose layer axis is sharded over a leading ``stage`` axis
   of the *union* of the parts' submeshes (`stack_layout`): each part's
   shards live only on its stage's devices, and the runtime views a stage's
   part as an array on that stage (`run.stacked`), zero-copy, both ways.

Limits (each an error that says so): the ranges must be of equal length (one
union `NamedSharding` cannot hold uneven parts); the parts' submeshes must be
distinct (no interleaving of one stack's ranges over the same device groups)
and of the same shape and axis names (they are stacked into the union mesh);
the scan must run in the step itself, not inside a remat of the whole stack or
a task's body. `parallelize` and `mjit` both split stacks. An NNX stack
(``nnx.vmap`` to build, ``nnx.scan`` to run) needs no scope of its own: its
body runs under the stacked module's attribute path (`trace.nnx_scopes`).
"""

from __future__ import annotations

import contextvars
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import jax
from jax import lax
from jax.core import ShapedArray
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal, Var

from .._compat.jax import equation_context
from ..core.jaxprs import subjaxprs
from ..trace.implicit import Registration, names_in, registered_tasks, scope_names, split_for
from ..trace.task import Placement
from .stack_layout import Boundary, SplitArray, StackSplit, check_stackable

__all__ = ["Rewritten", "check_split_registrations", "is_split_scan", "scan_scopes", "split_scans",
           "warn_whole_stacks"]

# -- 1. find ---------------------------------------------------------------------------


def _scan_groups(eqn: JaxprEqn) -> tuple[int, int, int]:
    """(consts, carry, xs) operand counts of a scan equation (JAX 0.12's ``ft_in``, or older params)."""
    p = eqn.params
    if "ft_in" in p:
        consts, carry, xs = p["ft_in"].unpack()
        return len(consts), len(carry), len(xs)
    return p["num_consts"], p["num_carry"], len(eqn.invars) - p["num_consts"] - p["num_carry"]


def _body(eqn: JaxprEqn) -> Any:
    body = eqn.params["jaxpr"]
    return getattr(body, "jaxpr", body)


def scan_scopes(eqn: JaxprEqn) -> list[str]:
    """A scan's scope names: its own, then those every equation of its body shares (Flax's module name)."""
    names = scope_names(eqn.source_info.name_stack)
    inner = _scoped(_body(eqn))
    if inner:
        shared = inner[0]
        for other in inner[1:]:
            n = 0
            while n < min(len(shared), len(other)) and shared[n] == other[n]:
                n += 1
            shared = shared[:n]
        names = names + list(shared)
    return [n for n in names if n]  # a transform wrapper with no scope inside (``jvp()``) names nothing


#: Scopes JAX itself opens inside a body (a rematerialised forward's): not the model's names.
_JAX_SCOPES = frozenset({"rematted_computation"})


def _scoped(jaxpr: Any) -> list[list[str]]:
    """The scope names of ``jaxpr``'s equations; one without a scope (a transpose's accumulation, the
    remat that wraps a rematerialised body) stands for the equations inside it."""
    out = []
    for e in jaxpr.eqns:
        names = [x for x in scope_names(e.source_info.name_stack) if x and x not in _JAX_SCOPES]
        if names:
            out.append(names)
        else:
            for sub in subjaxprs(e):
                out.extend(_scoped(sub))
    return out


def is_split_scan(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is a scan that a ``split=`` registration splits."""
    if eqn.primitive.name != "scan" or all(r.split is None for r in registered_tasks()):
        return False
    return split_for(scan_scopes(eqn)) is not None


def _split_registration(eqn: JaxprEqn) -> tuple[Registration, re.Match]:
    """The ``split=`` registration of a scan that `is_split_scan` found, and its match."""
    found = split_for(scan_scopes(eqn))
    if found is None:
        raise AssertionError(f"the scan at {str(eqn.source_info.name_stack) or '/'} has no split= registration")
    return found


def _stack_split(eqn: JaxprEqn) -> StackSplit | None:
    found = split_for(scan_scopes(eqn)) if eqn.primitive.name == "scan" else None
    if found is None:
        return None
    reg, match = found
    parts = reg.split_parts(match)
    ranges = tuple(r for r, _ in parts)
    who = f"register_task({reg.pattern.pattern!r}, split=...)"
    length = eqn.params["length"]
    if ranges[0][0] != 0 or ranges[-1][1] != length or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        raise ValueError(f"{who}: the scan {match.group(0)!r} runs {length} layers, but the split ranges "
                         f"{list(ranges)} do not cover [0, {length}) one after the other; give ranges "
                         f"(0, k1), (k1, k2), ..., (kn, {length})")
    return StackSplit(match.group(0), ranges, tuple(p for _, p in parts))


def _split_scans_within(jaxpr: Any, inside: tuple[str, ...] = ()) -> list[tuple[JaxprEqn, tuple[str, ...]]]:
    """Every split scan of ``jaxpr`` at any depth, with the primitives it sits inside (outermost first)."""
    found = []
    for e in jaxpr.eqns:
        if is_split_scan(e):
            found.append((e, inside))
            continue
        for sub in subjaxprs(e):
            found.extend(_split_scans_within(sub, inside + (e.primitive.name,)))
    return found


def check_split_registrations(jaxpr: Any) -> None:
    """A ``split=`` registration whose pattern names a scope of the step but no scan there is a mistake:
    say so, rather than leave the scope unplaced."""
    regs = [r for r in registered_tasks() if r.split is not None]
    if not regs:
        return
    used = {id(_split_registration(e)[0]) for e, _ in _split_scans_within(jaxpr)}
    names = names_in(jaxpr)
    for reg in regs:
        hit = sorted(n for n in names if reg.pattern.fullmatch(n))
        if hit and id(reg) not in used:
            raise ValueError(
                f"register_task({reg.pattern.pattern!r}, split=...) matches {hit}, which runs no scan: split= "
                f"cuts a scanned layer stack (nn.scan, nnx.scan or jax.lax.scan under that scope) by layer "
                f"ranges; to place separate modules, use callback= or devices=")


def warn_whole_stacks(eqns: Sequence[JaxprEqn], pinned: Sequence[bool], colour: Sequence[Placement]) -> None:
    """Warn about a scanned module stack that no registration placed, in a step over several submeshes: it
    runs whole where its neighbours put it, which is rarely what a per-layer pattern meant."""
    if len(set(colour)) < 2:
        return
    seen = set()
    for e, fixed, where in zip(eqns, pinned, colour):
        if e.primitive.name != "scan" or fixed or e.params["length"] < 2:
            continue
        own = [n for n in scope_names(e.source_info.name_stack) if n]
        module = scan_scopes(e)[len(own):]
        if module and module[-1] not in seen:
            seen.add(module[-1])
            warnings.warn(
                f"the scanned stack {module[-1]!r} ({e.params['length']} layers in one scan) matches no "
                f"registration and runs whole on {where.name!r}; a per-layer pattern cannot place the "
                f"layers of a scan: split it with register_task({module[-1]!r}, split={{(0, k): ..., "
                f"(k, {e.params['length']}): ...}}), or register its name to place it whole", stacklevel=5)


# -- 2. propagate -------------------------------------------------------------------------

_ELEMENTWISE = frozenset("""
    abs add add_any and atan2 cbrt ceil clamp convert_element_type copy copy_p cos div eq erf erf_inv exp exp2
    expm1 floor ge gt imag integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter not or
    pow real reduce_precision rem round rsqrt select_n sign sin sqrt square sub tan tanh xor
""".split()) | {"logical_constraint"}  # a deferred constraint: each part held to its names where it runs
_REDUCE_COMBINE: dict[str, Callable] = {"reduce_sum": lax.add, "reduce_max": lax.max, "reduce_min": lax.min}


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(v.aval.shape)


def _partners(eqn: JaxprEqn, v: Var, axis: int) -> dict[Var, int] | None:
    """If ``eqn`` can run part by part with ``v`` split along ``axis``: every value of it then split, with its
    axis (``v`` included); None when it cannot."""
    name, ins, outs = eqn.primitive.name, [x for x in eqn.invars if not isinstance(x, Literal)], eqn.outvars
    if name in _ELEMENTWISE:
        shape = _shape(v)
        arrays = [x for x in ins + outs if _shape(x)]
        if any(_shape(x) != shape for x in arrays):
            return None
        return {x: axis for x in arrays}
    if name == "transpose" and ins:
        perm = eqn.params["permutation"]
        (x,), (y,) = ins, outs
        return {x: axis, y: perm.index(axis)} if v is x else {x: perm[axis], y: axis}
    if name in _REDUCE_COMBINE and ins:
        reduced = set(eqn.params["axes"])
        (x,), (y,) = ins, outs
        kept = [d for d in range(len(_shape(x))) if d not in reduced]
        if v is y:
            return {x: kept[axis], y: axis}
        return {x: axis} if axis in reduced else {x: axis, y: kept.index(axis)}
    if name == "broadcast_in_dim":
        dims = eqn.params["broadcast_dimensions"]
        (y,) = outs
        operand = eqn.invars[0]
        if v is y:
            if (axis in dims and not isinstance(operand, Literal)
                    and _shape(operand)[dims.index(axis)] == _shape(y)[axis]):
                return {operand: dims.index(axis), y: axis}
            return {y: axis}  # each part broadcasts the whole (small) operand
        return {v: axis, y: dims[axis]} if _shape(v)[axis] == _shape(y)[dims[axis]] else None
    return None


def _propagate(eqns: Sequence[JaxprEqn], scans: dict[int, StackSplit]) -> dict[Var, SplitArray]:
    """Every value to hold in parts (see the module docstring, step 2)."""
    want: dict[Var, SplitArray] = {}
    for i, split in scans.items():
        e = eqns[i]
        nc, nk, _ = _scan_groups(e)
        for v in e.invars[nc + nk:] + e.outvars[nk:]:
            if not isinstance(v, Literal):
                want.setdefault(v, SplitArray(split, 0))
    changed = True
    while changed:
        changed = False
        for i, e in enumerate(eqns):
            if i in scans:
                continue
            for v in [x for x in e.invars if not isinstance(x, Literal)] + list(e.outvars):
                if v not in want:
                    continue
                found = want[v]
                partners = _partners(e, v, found.axis)
                if partners is None:
                    continue
                for w, axis in partners.items():
                    if w not in want and _shape(w)[axis] == found.split.length:
                        want[w] = SplitArray(found.split, axis)
                        changed = True
    return want


# -- 3. rewrite ----------------------------------------------------------------------------


@dataclass
class _Parts:
    """A value held as its parts along ``axis``."""

    how: SplitArray
    vals: list


#: While a step is rewritten: the labels of the split stacks whose parts were put back together (a copy).
_GATHERED: contextvars.ContextVar[list | None] = contextvars.ContextVar("multimesh_gathered", default=None)


def _whole(x: Any) -> Any:
    if isinstance(x, _Parts):
        log = _GATHERED.get()
        if log is not None:
            log.append(x.how.split.label)
        return lax.concatenate(x.vals, x.how.axis)
    return x


def _parts(x: Any, how: SplitArray) -> list:
    if isinstance(x, _Parts) and x.how == how:
        return x.vals
    whole = _whole(x)
    return [lax.slice_in_dim(whole, a, b, axis=how.axis) for a, b in how.split.ranges]


def _bind(eqn: JaxprEqn, ins: Sequence[Any], **changed: Any) -> list:
    params = eqn.primitive.get_bind_params({**eqn.params, **changed})
    with equation_context(eqn):
        outs = eqn.primitive.bind(*ins, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _split_scan(eqn: JaxprEqn, split: StackSplit, ins: list) -> list:
    """Consecutive scans over the parts, the carry threaded through (backwards for a reverse scan)."""
    nc, nk, _ = _scan_groups(eqn)
    consts, carry = [_whole(x) for x in ins[:nc]], [_whole(x) for x in ins[nc:nc + nk]]
    how = SplitArray(split, 0)
    xs = [_parts(x, how) for x in ins[nc + nk:]]
    ys: list[list] = [[None] * len(split.ranges) for _ in eqn.outvars[nk:]]
    order = range(len(split.ranges))
    for k in (reversed(order) if eqn.params["reverse"] else order):
        a, b = split.ranges[k]
        with jax.named_scope(split.markers[k]):
            outs = _bind(eqn, consts + carry + [x[k] for x in xs], length=b - a)
        carry = outs[:nk]
        for j, y in enumerate(outs[nk:]):
            ys[j][k] = y
    return carry + [_Parts(how, y) for y in ys]


def _by_parts(eqn: JaxprEqn, ins: list, want: dict[Var, SplitArray]) -> list | None:
    """``eqn`` run once per part (its outputs in parts), or reduced part by part and combined; None when it
    runs whole."""
    out = next((v for v in eqn.outvars if v in want), None)
    partners = _partners(eqn, out, want[out].axis) if out is not None else None
    if out is not None and partners is not None and all(v in partners for v in eqn.outvars):
        how = want[out]
        per_in = [_parts(x, SplitArray(how.split, partners[v])) if not isinstance(v, Literal) and v in partners
                  else None for v, x in zip(eqn.invars, ins)]
        results = []
        for k in range(len(how.split.ranges)):
            changed = {}
            if eqn.primitive.name == "broadcast_in_dim":
                changed["shape"] = how.part_shape(eqn.params["shape"], k)
            results.append(_bind(eqn, [p[k] if p is not None else _whole(x) for p, x in zip(per_in, ins)],
                                 **changed))
        return [_Parts(SplitArray(how.split, partners[v]), [r[j] for r in results])
                for j, v in enumerate(eqn.outvars)]
    combine = _REDUCE_COMBINE.get(eqn.primitive.name)
    if combine is not None and isinstance(ins[0], _Parts) and ins[0].how.axis in eqn.params["axes"]:
        partial = [_bind(eqn, [p])[0] for p in ins[0].vals]
        total = partial[0]
        for p in partial[1:]:
            total = combine(total, p)
        return [total]
    return None


@dataclass
class Rewritten:
    """The step with its scans split: the new program, its boundary, and where the part scans run."""

    closed: ClosedJaxpr
    boundary: Boundary
    placed: dict[int, Placement]
    splits: list[StackSplit]


def split_scans(closed: ClosedJaxpr) -> Rewritten | None:
    """``closed`` (nested calls inlined) with every registered scan split; None when none is."""
    if all(r.split is None for r in registered_tasks()):  # nothing to look for in every nested jaxpr
        return None
    jaxpr = closed.jaxpr
    for e, inside in _split_scans_within(jaxpr):
        if inside:
            raise NotImplementedError(
                f"the scan {_split_registration(e)[1].group(0)!r} registered with split= runs inside "
                f"{' > '.join(inside)}; a stack is split only where the step itself runs the scan (not inside "
                f"a jax.checkpoint/remat of the whole stack, a task, or a loop): put the remat inside the "
                f"scanned layer (nn.remat of the layer module) instead")
    scans = {i: s for i, e in enumerate(jaxpr.eqns) if (s := _stack_split(e)) is not None}
    if not scans:
        return None
    want = _propagate(jaxpr.eqns, scans)
    inputs = tuple(want.get(v) for v in jaxpr.invars)
    outputs: list[SplitArray | None] = []
    gathered: dict[str, list[str]] = {}

    def run(*flat: Any) -> list:
        env: dict[Var, Any] = dict(zip(jaxpr.constvars, closed.consts))
        args = iter(flat)
        for v, how in zip(jaxpr.invars, inputs):
            env[v] = next(args) if how is None else _Parts(how, [next(args) for _ in how.split.ranges])

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        stack = source_info_util.current_name_stack()
        log: list = []
        token = _GATHERED.set(log)
        for i, e in enumerate(jaxpr.eqns):
            before = len(log)
            ins = [read(v) for v in e.invars]
            with source_info_util.user_context(e.source_info.traceback, name_stack=stack + e.source_info.name_stack):
                if i in scans:
                    outs = _split_scan(e, scans[i], ins)
                elif (parts := _by_parts(e, ins, want)) is not None:
                    outs = parts
                else:
                    outs = _bind(e, [_whole(x) for x in ins])
            env.update(zip(e.outvars, outs))
            if len(log) > before:
                gathered.setdefault(log[-1], []).append(f"{e.primitive.name} at {str(e.source_info.name_stack) or '/'}")
        _GATHERED.reset(token)
        flat_out = []
        outputs.clear()
        for x in map(read, jaxpr.outvars):
            outputs.append(x.how if isinstance(x, _Parts) else None)
            flat_out.extend(x.vals if isinstance(x, _Parts) else [x])
        return flat_out

    avals: list[jax.ShapeDtypeStruct] = []
    for v, how in zip(jaxpr.invars, inputs):
        shapes = [_shape(v)] if how is None else [how.part_shape(_shape(v), k) for k in range(len(how.split.ranges))]
        dtype = cast(ShapedArray, v.aval).dtype  # a step's inputs are arrays; JAX types Var.aval as their base class
        avals.extend(jax.ShapeDtypeStruct(s, dtype) for s in shapes)
    new = jax.make_jaxpr(run)(*avals)
    for label, readers in gathered.items():
        shown = ", ".join(sorted(set(readers))[:5]) + (", ..." if len(set(readers)) > 5 else "")
        warnings.warn(f"split scan stack {label!r}: {len(readers)} equations read its layers whole ({shown}), so "
                      f"its parts are gathered (copied between stages) there; only elementwise arithmetic, "
                      f"transposes, broadcasts and reductions run part by part", stacklevel=6)
    splits = list(dict.fromkeys(scans.values()))
    where = {m: p for s in splits for m, p in zip(s.markers, s.placements)}
    placed = {}
    for e in new.jaxpr.eqns:
        names = scope_names(e.source_info.name_stack)
        if e.primitive.name == "scan" and names and names[-1] in where:
            placed[id(e)] = where[names[-1]]
    boundary = Boundary(inputs, tuple(outputs))
    for how in {h for h in boundary.inputs + boundary.outputs if h is not None}:
        check_stackable(how.split)
    return Rewritten(new, boundary, placed, splits)
