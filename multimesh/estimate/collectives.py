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
"unknown axes"). Given that assignment, each group is also kept as device
ids: which nodes its devices sit on decides the links it is priced over.

Bytes as sent: XLA:CPU has no bfloat16 collectives, so its float
normalization widens one to float32 (a convert to float32 before it, back to
bfloat16 after). A collective whose operand is such a widening (its value
last held in a narrower float type: a convert from it, through copies,
bitcasts and transposes, fused or not) counts at that narrower width, the
bytes a GPU or TPU sends: an FSDP step that gathers bfloat16 parameters is
priced as gathering bfloat16 when it is compiled on CPU, and an MoE layer's
all-to-all of bfloat16 tokens as sending bfloat16.

A collective is ``critical`` when, within its computation, its input is
computed by a matrix product and a matrix product waits for its result (a
tensor-parallel all-reduce of activations): it cannot run while those
products do. Every other collective can (a parameter's all-gather, which
depends on no product; a gradient's reduce-scatter or all-reduce, on which no
product depends): on devices whose compiler runs collectives asynchronously
and schedules independent compute beside them (XLA's latency-hiding
scheduler on GPU and TPU), it takes the links' time while the products take
theirs. A loop, call or conditional whose computations hold a product counts
as one.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from .hlo import Instruction, Module, calls_of, parse_module, shape_bytes

__all__ = ["KINDS", "Collective", "find_collectives"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


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
    #: the device ids of each of its groups (a permute's: each source-target pair), from the program's device
    #: assignment; None where not read (then it is priced by its group size alone)
    devices: tuple[tuple[int, ...], ...] | None = None
    #: whether a matrix product computes its input and another waits for its result (see the module
    #: docstring): it cannot overlap with the products around it
    critical: bool = False

    def nodes_spanned(self, node_of: Callable[[int], int]) -> int | None:
        """The most nodes any one of its groups spans, ``node_of(device id)`` its node (None: its devices not
        known)."""
        if not self.devices:
            return None
        return max(len({node_of(d) for d in g}) for g in self.devices)

    def per_node(self, node_of: Callable[[int], int]) -> int | None:
        """The most devices of any one of its groups on one node (None: its devices not known)."""
        if not self.devices:
            return None
        return max(max(sum(1 for d in g if node_of(d) == n) for n in {node_of(d) for d in g}) for g in self.devices)

    @property
    def axes_label(self) -> str:
        if self.axes is None:
            return "unknown axes"
        return ",".join(self.axes) if self.axes else "-"


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
        named = re.findall(r"'([^']+)'\s*=\s*(\d+)", mesh.group(1))
        if not named or ":" in mesh.group(2):  # sub-axes: not read
            return None
        names = [d for d, _ in named]
        sizes = [int(s) for _, s in named]
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


def _on_devices(groups: Sequence[Sequence[int]], device_ids: Sequence[int] | None) -> tuple | None:
    """Groups of positions in the device assignment as groups of device ids (None: no assignment given, or a
    position outside it)."""
    if device_ids is None or any(i >= len(device_ids) for g in groups for i in g):
        return None
    return tuple(tuple(int(device_ids[i]) for i in g) for g in groups)


_PRODUCTS = ("dot", "convolution")
_FLOAT_BITS = {"f64": 64, "f32": 32, "bf16": 16, "f16": 16}
_PASS_THROUGH = ("copy", "bitcast", "transpose", "reshape")


def _element_type(shape: str) -> str:
    m = re.match(r"\(?\s*([a-z]+\d*)\[", shape)
    return m.group(1) if m else ""


def _narrowest_source(module: Module, name: str, depth: int = 0) -> str:
    """The float type the value of instruction ``name`` was last held in before a widening convert (through
    copies, bitcasts, transposes, reshapes and fusions of them), or its own type."""
    ins = module.instruction(name)
    if ins is None or depth > 8:
        return ""
    if ins.opcode == "fusion":
        callee = next((c for c, how, _ in calls_of(ins) if how == "fused"), None)
        root = next((i for i in module.computations.get(callee or "", ()) if i.root), None)
        return _narrowest_source(module, root.name, depth + 1) if root is not None else _element_type(ins.shape)
    if ins.opcode in _PASS_THROUGH and len(ins.operands) == 1:
        return _narrowest_source(module, ins.operands[0], depth + 1)
    if ins.opcode == "convert" and len(ins.operands) == 1:
        source = _element_type(module.shape(ins.operands[0]))
        if _FLOAT_BITS.get(source, 99) < _FLOAT_BITS.get(_element_type(ins.shape), 0):
            return source
    return _element_type(ins.shape)


def _bytes_as_sent(module: Module, ins: Instruction, kind: str) -> int:
    """The collective's result bytes at the width its operand's value really has (module docstring)."""
    nbytes = shape_bytes(ins.shape)
    start = module.instruction(ins.operands[0]) if ins.opcode.endswith("-done") and ins.operands else ins
    if start is None or not start.operands or kind not in ("all-gather", "all-reduce", "reduce-scatter",
                                                           "all-to-all"):
        return nbytes
    wide = _FLOAT_BITS.get(_element_type(ins.shape))
    narrow = _FLOAT_BITS.get(_narrowest_source(module, start.operands[0]))
    return nbytes * narrow // wide if wide and narrow and narrow < wide else nbytes


def _holding_products(module: Module) -> set[str]:
    """The computations that compute a matrix product, themselves or through any computation they call."""
    holding = {name for name, body in module.computations.items() if any(i.opcode in _PRODUCTS for i in body)}
    while callers := {name for name, calls in module.calls.items()
                      if name not in holding and any(callee in holding for callee, _, _ in calls)}:
        holding |= callers
    return holding


def _is_product(ins: Instruction, holding: Collection[str]) -> bool:
    """Whether ``ins`` computes a matrix product: a dot or convolution, a library call for one (a gemm), or a
    fusion, loop, call or conditional whose computations hold one."""
    if ins.opcode in _PRODUCTS:
        return True
    if ins.opcode == "custom-call":
        return re.search(r"gemm|matmul|conv", ins.attributes, re.IGNORECASE) is not None
    return any(callee in holding for callee, _, _ in calls_of(ins))


def _critical(body: Sequence[Instruction], holding: Collection[str]) -> set[str]:
    """The names of ``body``'s instructions whose input a product computes and whose result a product waits
    for (``body`` in the text's order, each instruction after its operands)."""
    products = {i.name for i in body if _is_product(i, holding)}
    after: dict[str, bool] = {}
    users: dict[str, list[str]] = {}
    for ins in body:
        after[ins.name] = any(o in products or after.get(o, False) for o in ins.operands)
        for o in ins.operands:
            users.setdefault(o, []).append(ins.name)
    feeds: dict[str, bool] = {}
    for ins in reversed(body):
        feeds[ins.name] = any(u in products or feeds.get(u, False) for u in users.get(ins.name, ()))
    return {name for name, a in after.items() if a and feeds[name]}


def find_collectives(hlo_text: str | Module, axis_names: Sequence[str], axis_sizes: Sequence[int],
                     device_ids: Sequence[int] | None = None) -> list[Collective]:
    """Every collective of a compiled program's HLO (``compiled.as_text()`` or its `parse_module`), in text
    order. ``device_ids``: the program's device assignment (its mesh's device ids in order), which places
    each group's devices on nodes."""
    n_devices = int(np.prod(axis_sizes, dtype=np.int64))
    module = parse_module(hlo_text)
    runs = module.runs()
    holding = _holding_products(module)
    out = []
    for computation, body in module.computations.items():
        critical: set[str] | None = None
        for ins in body:
            if ins.opcode.endswith("-start"):  # an asynchronous pair counts once, at its -done
                continue
            kind = ins.opcode.removesuffix("-done")
            if kind not in KINDS:
                continue
            rest = ins.attributes
            if ins.opcode.endswith("-done") and ins.operands:  # the -done's shape, the -start's groups
                started = module.instruction(ins.operands[0])
                rest = started.attributes if started is not None else rest
            if kind == "collective-permute":
                groups = _pairs(rest) or []
                axes = _axes_of_pairs(groups, axis_names, axis_sizes)
                size = 2
            else:
                groups = _groups(rest, n_devices) or [list(range(n_devices))]
                axes = _axes_of_groups(groups, axis_names, axis_sizes)
                size = max(len(g) for g in groups)
            if critical is None:
                critical = _critical(body, holding)
            out.append(Collective(kind, _bytes_as_sent(module, ins, kind), size, axes, ins.name,
                                  count=runs.get(computation, 1), devices=_on_devices(groups, device_ids),
                                  critical=ins.name in critical))
    return out
