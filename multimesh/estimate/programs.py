"""The step's compiled programs, compiled from abstract inputs: XLA's memory and cost analyses and collectives.

SPMD: the step's one `jax.jit`, lowered with `jax.ShapeDtypeStruct`s carrying
the parameter and batch shardings. MPMD: the runtime's programs, compiled in
the runtime's order with the shardings their inputs would have when run (step
inputs: their layouts' shardings, moved as the runtime moves them; values from
another program: that program's output shardings, on the reader's submesh as
`core.transfer.target_on` puts them). A program whose module was compiled
before for a mesh of the same shape (another stage's, or an earlier
estimate's: `compiled_once`) is not compiled again. Nothing is allocated or
executed.
"""

from __future__ import annotations

import hashlib
import re
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from ..core.meshes import mesh_context, no_mesh_context
from ..core.transfer import target_on
from .collectives import Collective, find_collectives
from .compiler_log import Reshard, compile_noting_reshards
from .held import slice_bytes
from .hlo import parse_module
from .kernels import Kernel, find_kernels
from .matmuls import GroupedProduct, grouped_products, matmul_flops_by_dtype

__all__ = ["MPMDPrograms", "ProgramCost", "analyse_compiled", "mpmd_programs", "spmd_program"]


@dataclass(frozen=True)
class ProgramCost:
    """One compiled program, per device of its mesh: XLA's memory analysis (bytes), its ``flops`` (XLA's
    cost analysis, at least its matrix products'), ``bytes_accessed`` (its kernels' bytes, a loop body's once
    per iteration; XLA's count where no kernel was read), its collectives, its ``kernels`` (those of the
    ``platform`` it was compiled for), how often a step runs it (``executions``), and the arrays XLA
    warned it reshards by gathering them whole (``reshards``)."""

    name: str
    devices: frozenset[int]
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    bytes_accessed: float
    collectives: tuple[Collective, ...]
    executions: int = 1
    kernels: tuple[Kernel, ...] = field(default=(), repr=False)
    #: the JAX platform it was compiled for (its kernels are that platform's)
    platform: str = ""
    reshards: tuple[Reshard, ...] = ()
    #: (dtype, flops per device) of its matrix products, by the dtype their operands run in (counted from its
    #: jaxpr: `matmul_flops_by_dtype`); empty where not counted
    matmul_dtypes: tuple[tuple[str, float], ...] = ()
    #: of ``bytes_accessed``, those of attention score matrices (`kernels`), which a flash
    #: kernel keeps on chip: left out where the program is priced for another platform than its own
    attention_bytes: float = 0.0
    #: its grouped products (``ragged_dot``) as a grouped GEMM runs them, per device (`matmuls.grouped_products`):
    #: where XLA expanded them into dense products (kernels marked ``grouped``), what `timing` charges on a
    #: platform with grouped GEMMs instead
    grouped: tuple[Kernel, ...] = field(default=(), repr=False)

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs - outputs aliased to donated arguments + temporaries: every buffer of the
        program alive at once, an upper bound of what it needs while it runs."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def _cost(compiled: Any) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jaxlibs: one dict per program
        cost = cost[0] if cost else {}
    return cost or {}


#: Each compiled program's HLO as read (its collectives on a mesh's axes, its kernels), kept while the program
#: lives: the same program estimated again (on another profile, a search's twin) is not read again.
_READ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _read_hlo(compiled: Any, mesh: Mesh) -> tuple[tuple[Collective, ...], tuple[Kernel, ...]]:
    ids = tuple(int(d.id) for d in mesh.devices.flat)
    axes = (tuple(mesh.axis_names), tuple(int(s) for s in mesh.devices.shape), ids)
    read = _READ.setdefault(compiled, {})
    if axes not in read:
        module = parse_module(compiled.as_text())
        read[axes] = (tuple(find_collectives(module, list(axes[0]), list(axes[1]), ids)),
                      find_kernels(module))
    return read[axes]


def analyse_compiled(name: str, compiled: Any, mesh: Mesh, executions: int = 1,
                     matmuls: Mapping[str, float] | None = None, reshards: tuple[Reshard, ...] = (),
                     grouped: tuple[GroupedProduct, ...] = ()) -> ProgramCost:
    """A `ProgramCost` from a `jax.stages.Compiled` of a program on ``mesh``. ``matmuls``: the flops of its
    matrix products by dtype, counted from its jaxpr (`matmul_flops_by_dtype`, global arrays): the flops per
    device are at least those over the devices, where XLA's count misses some (a loop body counted once, GPU
    library calls).
    ``reshards``: what XLA warned of while compiling it (`compiled_once`). ``grouped``: its grouped products
    (`grouped_products`, global arrays), kept per device as kernels."""
    memory = compiled.memory_analysis()
    cost = _cost(compiled)
    collectives, kernels = _read_hlo(compiled, mesh)
    moved = sum(k.bytes * k.count for k in kernels) if kernels else float(cost.get("bytes accessed", 0.0))
    per_device = {k: v / mesh.devices.size for k, v in (matmuls or {}).items()}
    return ProgramCost(
        name=name, devices=frozenset(d.id for d in mesh.devices.flat),
        argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        flops=max(float(cost.get("flops", 0.0)), sum(per_device.values())), bytes_accessed=float(moved),
        collectives=collectives, executions=executions, kernels=kernels,
        platform=mesh.devices.flat[0].platform, reshards=reshards, matmul_dtypes=tuple(sorted(per_device.items())),
        attention_bytes=float(sum(k.attention_bytes * k.count for k in kernels)),
        grouped=tuple(Kernel(g.flops / mesh.devices.size, -(-g.bytes // mesh.devices.size), g.count, g.dtype)
                      for g in grouped))


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def spmd_program(step_fn: Any, args: tuple = ()) -> ProgramCost:
    """The SPMD step's one program, compiled for its parameter and batch layouts (and ``args``, the step's
    further arguments, arrays or `jax.ShapeDtypeStruct`s)."""
    batch = _abstract(step_fn._abstract_batch, step_fn.batch_shardings)
    with mesh_context(step_fn.mesh):
        traced = step_fn.trace(step_fn.abstract_params, batch, *args)
        compiled, reshards = compiled_once(traced.lower(), step_fn.mesh)
    return analyse_compiled(getattr(step_fn.fun, "__name__", "step"), compiled, step_fn.mesh,
                            matmuls=matmul_flops_by_dtype(traced.jaxpr), reshards=reshards,
                            grouped=grouped_products(traced.jaxpr))


@dataclass(frozen=True)
class MPMDPrograms:
    """The MPMD step's programs (`ProgramCost`, ``executions`` counting the segments that call each) and,
    per stashed forward activation, its stage, its (microbatch, chunk) and the bytes of its shard per device."""

    programs: tuple[ProgramCost, ...]
    stash: tuple[tuple[int, tuple, dict[int, int]], ...]
    #: segment index -> index in ``programs`` of the program it runs
    segment_program: dict[int, int]


def _placed(x: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _unnamed(module: str) -> str:
    """A module's text without its name (``module @jit_stage1_program1``): the one line like stages differ in."""
    return re.sub(r"^module @\S+", "module", module, count=1)


#: Programs compiled for estimates, the most recently used last: (module digest, platform, device kind, mesh
#: shape, axis names) -> (compiled, what XLA warned of while compiling it). Kept across estimates, so that a
#: stage like another, the same step on another profile and a layout a search tried before are compiled once.
_COMPILED: OrderedDict[tuple, Any] = OrderedDict()
_KEPT = 64

#: XLA:CPU options for programs compiled only to be read, never run: LLVM's machine-code optimisation
#: skipped (about half of an 8B model step's compile time here), which leaves the optimised HLO, its
#: buffers (the memory analysis) and so every figure an estimate reads unchanged.
_READ_ONLY_CPU = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def compiled_once(lowered: Any, mesh: Mesh) -> tuple[Any, tuple[Reshard, ...]]:
    """``lowered`` compiled, or the program compiled before from the same module (but for its name) for a mesh
    of the same shape and kind of device: XLA's analyses of it, per device, are the same; and the arrays XLA
    warned it reshards by gathering them whole (`compile_noting_reshards`), which it says only when compiling."""
    device = mesh.devices.flat[0]
    text = lowered.as_text()
    key = (hashlib.sha256(_unnamed(text).encode()).digest(), device.platform, device.device_kind,
           mesh.devices.shape, mesh.axis_names)
    compiled = _COMPILED.pop(key, None)
    if compiled is None:
        compiled = compile_noting_reshards(lowered, _READ_ONLY_CPU if device.platform == "cpu" else None, text=text)
    _COMPILED[key] = compiled
    while len(_COMPILED) > _KEPT:
        _COMPILED.popitem(last=False)
    return compiled


def _moved_to(sharding: Any, mesh: Mesh) -> Any:
    """A program's output sharding on ``mesh``: the same spec, where it was compiled for a like mesh, and the
    same axis types (a value the program made under `jax.sharding.auto_axes` is typed on Auto axes of an
    Explicit mesh, as the run's arrays are, and the program that takes it was traced so)."""
    if isinstance(sharding, NamedSharding) and sharding.mesh.devices.shape == mesh.devices.shape:
        if sharding.mesh.axis_types != mesh.axis_types:
            mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=sharding.mesh.axis_types)
        return NamedSharding(mesh, sharding.spec)
    return sharding


def mpmd_programs(runtime: Any) -> MPMDPrograms:
    """Compile every program of an MPMD runtime from abstract inputs, walking its steps in order."""
    plan = runtime.plan
    held: dict[Any, Any] = {}
    for v in plan.jaxpr.invars:
        held[(v, None)] = jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=runtime.input_shardings[v])
    held.update(((v, None), x) for v, x in plan.consts.items())
    program_of = {k: p for p in runtime.programs for k in p.segments}
    compiled: dict[tuple, Any] = {}
    calls: dict[tuple, int] = {}
    runs: dict[int, tuple] = {}  # segment index -> key of its compiled program
    with no_mesh_context():
        for step in runtime.steps:
            seg = step.segment
            mesh = seg.placement.mesh
            for v, key in step.inputs:
                x = held[(v, None)]
                target = runtime.input_shardings.get(v)
                if target is not None and not target.device_set <= seg.placement.devices:
                    target = None
                here = getattr(x, "sharding", None)
                if here is not None and (here.device_set == seg.placement.devices or here == target):
                    held[key] = x
                else:
                    held[key] = _placed(x, target if target is not None else target_on(x, mesh))
            for _, src, dst in step.copies:
                held[dst] = _placed(held[src], target_on(held[src], mesh))
            args = [held[k] for k in step.args]
            key = (id(step.fn), tuple(getattr(a, "sharding", None) for a in args))
            if key not in compiled:
                traced = step.fn.trace(*args, *step.literals)
                compiled[key] = (*compiled_once(traced.lower(), mesh), program_of[seg.index], mesh,
                                 matmul_flops_by_dtype(traced.jaxpr), grouped_products(traced.jaxpr))
            calls[key] = calls.get(key, 0) + 1
            runs[seg.index] = key
            outs = [_moved_to(s, mesh) for s in jax.tree.leaves(compiled[key][0].output_shardings)]
            for (v, _), k, s in zip([(o[0], None) for o in step.outs], step.outs, outs):
                held[k] = jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=s)
    programs: list[ProgramCost] = []
    position: dict[Any, int] = {}
    for key, (c, reshards, program, mesh, matmuls, grouped) in compiled.items():
        name = f"{program.placement.name or 'default'}_program{program.index}"
        if any(p.name == name for p in programs):  # one program compiled for two sets of input shardings
            name += f".{sum(p.name.startswith(name) for p in programs)}"
        position[key] = len(programs)
        programs.append(analyse_compiled(name, c, mesh, executions=calls[key], matmuls=matmuls, reshards=reshards,
                                         grouped=grouped))
    stash = tuple((stage, label, slice_bytes(tuple(held[k].shape), held[k].dtype.itemsize, held[k].sharding))
                  for k, (stage, label) in runtime.stashed().items() if k in held)
    return MPMDPrograms(tuple(programs), stash, {k: position[key] for k, key in runs.items()})
