"""The kernels of a compiled program, read from its HLO: each one's matrix flops, bytes moved, and executions.

A kernel is an instruction of code that runs (the entry computation, loop
bodies and conditions, branches, called computations; not the computations
fused into a kernel) that does work: a fusion, a matrix product, a copy, a
custom call, ... Parameters, constants, tuples, bitcasts, control flow and
the collectives (timed on their own, `collectives`) are not kernels.

Bytes are those a kernel reads and writes: its operands' and its result's,
except where it touches part of an array, which is what a scanned stack does
every iteration: a fused parameter read only through ``dynamic-slice`` (or
``slice``) counts the slices' bytes, and a ``dynamic-update-slice`` into a
buffer updated in place counts the update's bytes, not the buffer's. Flops
are the matrix products' (``dot``, and a library call such as a cuBLAS gemm
whose dimension numbers it prints): 2 x result elements x contracted size,
in the dtype of the product's operands (a fusion's: its first product's). A
cuDNN flash-attention call (``__cudnn$fmha...``, what
``jax.nn.dot_product_attention(implementation="cudnn")`` compiles to) prints
no dimension numbers: its products are counted from its query
``[batch, length, heads, head_dim]`` and key ``[batch, kv_length, kv_heads,
head_dim]`` operands (`_flash_flops`), and its score matrices never leave the
chip, so it has no attention bytes.
A kernel XLA made from a grouped product's dense expansion (`grouped`:
``ragged_dot`` where the platform has no grouped GEMM) is marked
``grouped``. Elementwise arithmetic is left to the program's total (its bytes dominate
such a kernel's time). A kernel in a loop body counts once per iteration.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

from .collectives import KINDS
from .grouped import expanded_kernels
from .hlo import Instruction, Module, parse_module, shape_bytes
from .precision import work_dtype

__all__ = ["Kernel", "find_kernels"]

#: Instructions that are not kernels: no work of their own, control flow, or timed elsewhere (collectives).
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id",
                "while", "conditional", "call", "after-all", "opt-barrier", "add-dependency", "domain", "send",
                "send-done", "recv", "recv-done", "collective-broadcast", "ragged-all-to-all", *KINDS}
_RUNS_AS_CODE = ("body", "condition", "branch", "call")
_SLICES = {"dynamic-slice", "slice"}
_DIMS = re.compile(r"\[([\d,]*)\]")
_ELEMENT = re.compile(r"\s*\(?\s*([a-z]+\d*(?:e\d+m\d+\w*)?)\[")
_CONTRACTING = re.compile(r'lhs_contracting_dim(?:s=\{|ensions"\s*:\s*\[)([^}\]]*)')


@dataclass(frozen=True)
class Kernel:
    """Kernels alike: ``flops`` and ``bytes`` of one execution, ``count`` executions per program run."""

    flops: float
    bytes: int
    count: int = 1
    #: the dtype its matrix products' operands run in (`precision.profile_dtype`); '' where it has none
    dtype: str = ""
    #: of ``bytes``, those of attention score matrices it reads or writes (the results of a batched product
    #: larger than its operands, and what is computed from them at their size: scale, mask, softmax), which a
    #: flash-attention kernel keeps on chip
    attention_bytes: int = 0
    #: made from a grouped product's dense expansion (`grouped.expanded_kernels`): the masked copy of its rows,
    #: that copy's layouts, or the dense product over every group; what a grouped GEMM replaces
    grouped: bool = False


def _dims(shape: str) -> list[int]:
    m = _DIMS.search(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _product_flops(ins: Instruction, module: Module) -> float:
    """2 x result elements x contracted elements of a matrix product (0 if its dimensions are not printed)."""
    contracting = _CONTRACTING.search(ins.attributes)
    if contracting is None or not ins.operands:
        return 0.0
    lhs = _dims(module.shape(ins.operands[0]))
    dims = [int(d.strip().strip('"')) for d in contracting.group(1).split(",") if d.strip().strip('"')]
    if any(d >= len(lhs) for d in dims):
        return 0.0
    return 2.0 * math.prod(_dims(ins.shape)) * math.prod(lhs[d] for d in dims)


_FLASH = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')


def _flash_flops(ins: Instruction, module: Module) -> float:
    """A cuDNN flash-attention call's matrix flops: ``Q K^T`` and ``P V`` forward, each
    ``2 x batch x heads x length x kv_length x head_dim``; backward five (``Q K^T`` again, ``dO V^T``,
    ``P^T dO``, ``dS K``, ``dS^T Q``); half of each where a causal mask skips the blocks above the diagonal.
    0 for any other instruction."""
    m = _FLASH.search(ins.attributes) if ins.opcode == "custom-call" else None
    if m is None or len(ins.operands) < 2:
        return 0.0
    q, k = _dims(module.shape(ins.operands[0])), _dims(module.shape(ins.operands[1]))
    if len(q) != 4 or len(k) != 4:
        return 0.0
    products = 5 if "Backward" in m.group(1) else 2
    causal = 0.5 if "CAUSAL" in ins.attributes.upper() else 1.0
    return products * 2.0 * math.prod(q) * k[1] * causal


def _product_dtype(ins: Instruction, module: Module) -> str:
    """The dtype a matrix product runs in: its operands' (the wider of two), read from their HLO shapes."""
    kinds = [m.group(1) for o in ins.operands[:2] if (m := _ELEMENT.match(module.shape(o))) is not None]
    if not kinds:
        return ""
    return work_dtype(kinds[0], kinds[-1])


def _fused(ins: Instruction, module: Module) -> tuple[Instruction, ...]:
    m = re.search(r"\bcalls=%?([\w.\-]+)", ins.attributes)
    return module.computations.get(m.group(1), ()) if m else ()


def _fusion_bytes(ins: Instruction, module: Module, body: tuple[Instruction, ...]) -> int:
    """A fusion's bytes: each operand whole, or the slices read of it; its result whole, or the updates
    written into a buffer updated in place."""
    params: dict[int, str] = {}
    users: dict[str, list[Instruction]] = {}
    for f in body:
        if f.opcode == "parameter" and f.literal.isdigit():
            params[int(f.literal)] = f.name
        for o in f.operands:
            users.setdefault(o, []).append(f)
    root = next((f for f in body if f.root), None)
    results: list[Instruction | None]
    if root is None:  # its fused computation not printed: the result whole
        results, written = [], shape_bytes(ins.shape)
    else:
        results = [module.instruction(o) for o in root.operands] if root.opcode == "tuple" else [root]
        written = 0
    updated = set()  # fused parameters that are buffers updated in place
    for r in filter(None, results):
        if r.opcode == "dynamic-update-slice" and len(r.operands) > 1:
            updated.add(r.operands[0])
            written += shape_bytes(module.shape(r.operands[1]))
        else:
            written += shape_bytes(r.shape)
    read = 0
    for i, operand in enumerate(ins.operands):
        p = params.get(i)
        uses = users.get(p, []) if p is not None else []
        if p in updated and all(u.opcode == "dynamic-update-slice" and u.operands[0] == p for u in uses):
            continue
        if uses and all(u.opcode in _SLICES and u.operands[0] == p for u in uses):
            read += sum(shape_bytes(u.shape) for u in uses)
        else:
            read += shape_bytes(module.shape(operand))
    return read + written


_ARRAYS = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_BATCHED = re.compile(r"lhs_batch_dims=\{\d")


def _elements(shape: str) -> list[int]:
    """Element counts of the arrays of an HLO shape (a tuple's each)."""
    return [math.prod(int(x) for x in dims.split(",") if x) for _, dims in _ARRAYS.findall(shape)]


def _attention_product(ins: Instruction, module: Module) -> bool:
    """A batched matrix product (batch dimensions: batch and heads) whose result is larger than each of its
    operands: an attention's ``Q K^T`` (or, backward, ``dO V^T``), itself or fused into ``ins``."""
    dots = [ins] if ins.opcode == "dot" else [f for f in _fused(ins, module) if f.opcode == "dot"]
    for d in dots:
        out = sum(_elements(d.shape))
        if _BATCHED.search(d.attributes) and all(out > sum(_elements(module.shape(o))) for o in d.operands[:2]):
            return True
    return False


def _scores(module: Module) -> set[str]:
    """The instructions whose results are attention score matrices: an attention product's result, and every
    result of the same size computed from one (its scale, mask, softmax, conversions, copies and layouts),
    the chain a flash-attention kernel keeps on chip."""
    found: set[str] = set()
    for body in module.computations.values():
        for ins in body:
            if ins.opcode == "parameter":
                continue
            if _attention_product(ins, module):
                found.add(ins.name)
                continue
            sizes = {n for o in ins.operands if o in found for n in _elements(module.shape(o))}
            if sizes and any(n in sizes for n in _elements(ins.shape)):
                found.add(ins.name)
    return found


def _kernel(ins: Instruction, module: Module, scores: Collection[str] = frozenset(),
            expanded: Collection[str] = frozenset()) -> Kernel | None:
    k = _kernel_io(ins, module)
    if k is None:
        return k
    moved = sum(shape_bytes(module.shape(o)) for o in ins.operands if o in scores)
    if ins.name in scores:
        moved += shape_bytes(ins.shape)
    return Kernel(k.flops, k.bytes, k.count, k.dtype, min(moved, k.bytes), ins.name in expanded)


def _kernel_io(ins: Instruction, module: Module) -> Kernel | None:
    if ins.opcode in _NOT_KERNELS or ins.opcode.endswith(("-start", "-done", "-update")):
        return None
    if ins.opcode == "fusion":
        body = _fused(ins, module)
        dots = [f for f in body if f.opcode == "dot"]
        return Kernel(sum(_product_flops(f, module) for f in dots), _fusion_bytes(ins, module, body),
                      dtype=_product_dtype(dots[0], module) if dots else "")
    if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
        return Kernel(0.0, 2 * shape_bytes(module.shape(ins.operands[1])))
    if ins.opcode in _SLICES:
        return Kernel(0.0, 2 * shape_bytes(ins.shape))
    flops = _product_flops(ins, module) if ins.opcode in ("dot", "custom-call") else 0.0
    flops = flops or _flash_flops(ins, module)
    return Kernel(flops, shape_bytes(ins.shape) + sum(shape_bytes(module.shape(o)) for o in ins.operands),
                  dtype=_product_dtype(ins, module) if flops else "")


def find_kernels(hlo_text: str | Module) -> tuple[Kernel, ...]:
    """The kernels of a compiled program's HLO (``compiled.as_text()`` or its `parse_module`), kernels alike
    merged (their counts summed), largest bytes first; each with the bytes of attention score matrices it
    moves (`_scores`), and whether it was made from a grouped product's dense expansion."""
    module = parse_module(hlo_text)
    scores, expanded = _scores(module), expanded_kernels(module)
    counts: Counter[tuple[float, int, str, int, bool]] = Counter()
    for ins, times in module.executed(_RUNS_AS_CODE):
        k = _kernel(ins, module, scores, expanded)
        if k is not None and (k.flops or k.bytes):
            counts[(k.flops, k.bytes, k.dtype, k.attention_bytes, k.grouped)] += times
    return tuple(Kernel(f, b, n, d, a, g) for (f, b, d, a, g), n in sorted(
        counts.items(), key=lambda kv: (-kv[0][1], -kv[0][0], kv[0][2], kv[0][3], kv[0][4])))
