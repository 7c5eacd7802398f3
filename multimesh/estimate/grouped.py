"""The kernels XLA made from a grouped product's dense expansion, found in a compiled program's HLO.

A grouped product (``jax.lax.ragged_dot``: a Mixture of Experts' experts,
each row through its own group's matrix) compiles to a grouped GEMM on a GPU
or TPU. Elsewhere (XLA:CPU) JAX lowers it to a dense product over every
group: the rows are broadcast to ``[groups, ...]`` and masked by
``select(starts <= iota < ends, rows, 0)`` (the expansion), laid out, and
multiplied by all the groups' matrices at once, ``groups`` times the real
work. `expanded_kernels` finds those instructions: an expansion (a
``select`` of a ``broadcast`` under a group mask, an ``and`` of two
compares of an ``iota``, itself or in its fused computation; the mask
computed in place or in a kernel of its own, which several expansions
share), that mask's kernel, the data movement that carries the expansion
(copies, transposes, conversions), and the matrix products that read it.
`timing` prices a program compiled so for another platform with the traced
program's grouped products (`matmuls.grouped_products`) in their place.
"""

from __future__ import annotations

import re

from .hlo import Instruction, Module

__all__ = ["expanded_kernels"]

#: Opcodes that move or retype data without arithmetic: they carry an expansion to its product.
_MOVES = {"copy", "transpose", "bitcast", "convert", "reshape", "broadcast", "parameter", "constant",
          "get-tuple-element", "tuple", "slice", "dynamic-slice"}
_PRODUCTS = {"dot", "custom-call"}
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")


def _body(ins: Instruction, module: Module) -> tuple[Instruction, ...]:
    m = _CALLS.search(ins.attributes) if ins.opcode == "fusion" else None
    return module.computations.get(m.group(1), ()) if m else ()


def _is_mask(ins: Instruction | None, local: dict[str, Instruction]) -> bool:
    """``and(compare(.., iota), compare(iota, ..))``: which rows of the broadcast belong to each group."""
    if ins is None or ins.opcode != "and":
        return False
    compares = [local.get(o) for o in ins.operands]
    if not all(c is not None and c.opcode == "compare" for c in compares):
        return False
    return any(getattr(local.get(o), "opcode", "") == "iota" for c in compares if c for o in c.operands)


def _computes_mask(ins: Instruction, module: Module, around: dict[str, Instruction]) -> bool:
    """Whether ``ins`` is a group mask, or a fusion whose result is one (XLA computes a mask shared by several
    products once, in a kernel of its own)."""
    body = _body(ins, module)
    if not body:
        return _is_mask(ins, around)
    local = {f.name: f for f in body}
    return any(f.root and _is_mask(f, local) for f in body)


def _masks_used(select: Instruction, local: dict[str, Instruction], outer: dict[str, str]) -> str | None:
    """For ``select(mask, broadcast(x), ...)``: the mask's name (``outer``: a fused parameter's name -> the
    mask kernel it reads), '' where the mask is computed in place; None for any other instruction."""
    if select.opcode != "select" or len(select.operands) != 3:
        return None
    pred, on_true = local.get(select.operands[0]), local.get(select.operands[1])
    if pred is None or on_true is None or on_true.opcode != "broadcast":
        return None
    if _is_mask(pred, local):
        return ""
    return outer.get(pred.name)


def _expansion(ins: Instruction, module: Module, around: dict[str, Instruction], masks: set[str]) -> str | None:
    """Whether ``ins`` (in a computation of instructions ``around``), or the computation fused into it, makes a
    grouped product's expansion: the name of the mask kernel it reads ('' for none), else None."""
    body = _body(ins, module)
    if not body:
        return _masks_used(ins, around, {o: o for o in ins.operands if o in masks})
    outer = {f.name: ins.operands[int(f.literal)] for f in body
             if f.opcode == "parameter" and f.literal.isdigit() and int(f.literal) < len(ins.operands)
             and ins.operands[int(f.literal)] in masks}
    local = {f.name: f for f in body}
    used = [m for f in body if (m := _masks_used(f, local, outer)) is not None]
    return used[0] if used else None


def _multiplies(ins: Instruction, module: Module) -> bool:
    """Whether ``ins`` is (or fuses) a matrix product."""
    return ins.opcode in _PRODUCTS or any(f.opcode == "dot" for f in _body(ins, module))


def _only_moves(ins: Instruction, module: Module) -> bool:
    body = _body(ins, module)
    return all(f.opcode in _MOVES for f in body) if body else ins.opcode in _MOVES


def expanded_kernels(module: Module) -> set[str]:
    """Names of the instructions (of the computations that run as code) that compute, carry or multiply a
    grouped product's dense expansion, and the group masks they read (see the module docstring); empty where
    XLA made none (a program compiled for a platform with grouped GEMMs)."""
    found: set[str] = set()
    for body in module.computations.values():  # a fused computation's marks are never read: not kernels
        around = {ins.name: ins for ins in body}
        masks: set[str] = set()  # kernels that compute a group mask, found in an expansion once one reads them
        carrying: set[str] = set()  # expansions and what moves them: their results are still the expansion
        for ins in body:
            used = _expansion(ins, module, around, masks)
            if used is not None:
                carrying.add(ins.name)
                if used:
                    found.add(used)
            elif _computes_mask(ins, module, around):
                masks.add(ins.name)
            elif any(o in carrying for o in ins.operands):
                if _multiplies(ins, module):
                    found.add(ins.name)
                elif _only_moves(ins, module):
                    carrying.add(ins.name)
        found |= carrying
    return found
