"""`estimate(step_fn)`: the `Estimate` of a step built by `parallelize` (SPMD or MPMD), without running it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ..core.fmt import keypath_str
from ..core.layout import LeafLayout
from .held import DEFAULT_OPTIMIZER_PATHS, held_bytes
from .matmuls import grouped_products, matmul_flops_by_dtype
from .precision import dtype_label, main_dtype, rate_for
from .profiles import HardwareProfile, get_profile
from .programs import ProgramCost, analyse_compiled, compiled_once, mpmd_programs, spmd_program
from .report import DeviceMemory, Estimate, StepTime
from .steptime import step_timing
from .timing import compute_time, on_platform, overlaps_collectives
from .utilisation import utilisation

__all__ = ["estimate", "estimate_mjit"]

_NOTES = (
    "params, optimizer and batch are exact (the layouts' shards); outputs and temp are XLA's analysis of the "
    "programs compiled for this backend, which can differ on another (CPU compilation's temporaries are not a GPU's)",
    "a loop body (scan) counts once per iteration (the loop's known trip count): its kernels' bytes, its "
    "collectives, and its matrix products' flops",
)


def _stage_names(placements: Any) -> dict[int, str]:
    """Device id -> the names of the submeshes it belongs to (``"default"``: the step's own mesh)."""
    names: dict[int, list[str]] = {}
    for p in placements:
        for d in p.mesh.devices.flat:
            names.setdefault(d.id, []).append(p.name or "default")
    return {d: "+".join(dict.fromkeys(n)) for d, n in names.items()}


def _stashed_peak(plan: Any, stash: tuple, stage_index: dict[int, int]) -> dict[int, int]:
    """Per device: the schedule's peak live microbatches on its stage x the most one microbatch stashes there."""
    schedule = plan.schedule
    if schedule is None or not stash:
        return {}
    per_label: dict[tuple[int, tuple, int], int] = {}
    for stage, label, shards in stash:
        for d, n in shards.items():
            per_label[(stage, label, d)] = per_label.get((stage, label, d), 0) + n
    most: dict[int, int] = {}
    for (stage, _, d), n in per_label.items():
        most[d] = max(most.get(d, 0), n)
    peaks = schedule.peak_live_activations
    return {d: n * peaks.get(stage_index.get(d, -1), 0) for d, n in most.items()}


def estimate(step_fn: Any, profile: str | HardwareProfile | None = None, *, args: tuple = (),
             dtype: str | None = None, model_flops: float | None = None,
             optimizer_paths: str = DEFAULT_OPTIMIZER_PATHS) -> Estimate:
    """Memory per device, work and (with a ``profile``) predicted step time of ``step_fn``.

    ``step_fn``: a step built by `parallelize` (`ShardedFunction` or
    `MPMDFunction`). Its programs are compiled from abstract inputs; nothing
    is allocated. ``profile``: a `HardwareProfile` or a name from
    `PROFILES`. ``args``: an SPMD step's arguments after the parameters and
    the batch (arrays or `jax.ShapeDtypeStruct`s), as it is called.
    ``dtype``: an override, every flop priced at that dtype's peak (default:
    each matrix product at the peak of the dtype its operands run in, read
    from the program: bf16 operands with f32 accumulation are bf16 work).
    ``model_flops``: the flops one step of the model needs (`model_flops`: 6
    x parameters x tokens + attention, no recomputation), for MFU; without
    it only HFU (the compiled programs' flops, recomputation included) is
    reported. ``optimizer_paths``: a regular expression of the parameter
    paths that are optimizer state.
    """
    runtime = getattr(step_fn, "runtime", None)
    if runtime is None and not hasattr(step_fn, "lower"):
        raise TypeError(f"estimate needs a step built by parallelize (a ShardedFunction or MPMDFunction), "
                        f"not {type(step_fn).__name__}")
    name = getattr(step_fn.fun, "__name__", "step")
    if runtime is None and step_fn.plan is None and not args:
        raise TypeError(f"estimate: step {name!r} takes more arguments than (params, batch), and its program is "
                        f"compiled for the arguments it is called with: pass the others as "
                        f"estimate(step, args=(...)) (arrays or jax.ShapeDtypeStruct)")
    if runtime is not None and args:
        raise TypeError(f"estimate: step {name!r} is a pipeline (MPMD) step, called as step(params, batch): "
                        f"it takes no args=")
    placements = step_fn.plan.placements if runtime is not None else [step_fn.placement]
    spmd = None if runtime is not None else (lambda: spmd_program(step_fn, tuple(args)))
    return _estimate(name, step_fn.plan, runtime, spmd, placements, step_fn.param_layout.leaves,
                     step_fn.batch_layout.leaves, profile, dtype, model_flops, optimizer_paths)


def estimate_mjit(fn: Any, args: tuple, profile: str | HardwareProfile | None = None, *, dtype: str | None = None,
                  model_flops: float | None = None, optimizer_paths: str = DEFAULT_OPTIMIZER_PATHS) -> Estimate:
    """The `Estimate` of a call of the `mjit` function ``fn`` with ``args`` (arrays, or
    `jax.ShapeDtypeStruct`s with shardings), compiled from abstract inputs; nothing runs. `mjit` knows no
    batch: every argument leaf outside ``optimizer_paths`` counts as ``params``."""
    leaves = []
    for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            raise TypeError(f"estimate of mjit({fn.__name__}): argument args{jax.tree_util.keystr(path)} has no "
                            f"sharding: pass a jax.Array or jax.ShapeDtypeStruct(shape, dtype, sharding=...) for "
                            f"every leaf")
        leaves.append(LeafLayout(keypath_str(path), tuple(x.shape), x.dtype, None, "argument", sharding))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), args)
    compiled, abstract = fn.compiled_for(*abstract)
    spmd: Callable[[], ProgramCost] | None = None
    if compiled.runtime is None:
        def spmd() -> ProgramCost:
            traced = compiled.jitted.trace(*jax.tree.leaves(abstract))
            mesh = compiled.plan.placements[0].mesh
            program, reshards = compiled_once(traced.lower(), mesh)
            return analyse_compiled(fn.__name__, program, mesh, matmuls=matmul_flops_by_dtype(traced.jaxpr),
                                    reshards=reshards, grouped=grouped_products(traced.jaxpr))
    return _estimate(fn.__name__, compiled.plan, compiled.runtime, spmd, compiled.plan.placements, leaves, (),
                     profile, dtype, model_flops, optimizer_paths)


def _estimate(name: str, plan: Any, runtime: Any, spmd: Any, placements: Any, param_leaves: Any,
              batch_leaves: Any, profile: str | HardwareProfile | None, dtype: str | None, model_flops: float | None,
              optimizer_paths: str) -> Estimate:
    """The estimate of a planned step: ``runtime`` its MPMD runtime, or ``spmd()`` compiling its one program."""
    if profile is not None:
        profile = get_profile(profile)
    held = held_bytes(param_leaves, batch_leaves, optimizer_paths)
    stashed: dict[int, int] = {}
    transfers: tuple = ()
    segment_program: dict[int, int] | None = None
    if runtime is None:
        programs: tuple[ProgramCost, ...] = (spmd(),)
    else:
        built = mpmd_programs(runtime)
        programs = built.programs
        segment_program = built.segment_program
        stage_index = {d: s.stage for s in plan.segments if s.stage is not None for d in
                       (x.id for x in s.placement.devices)}
        stashed = _stashed_peak(plan, built.stash, stage_index)
        transfers = tuple((what, src, dst, size) for what, src, dst, _, size in plan.transfers())
    memory = {}
    for d, stage in sorted(_stage_names(placements).items()):
        mine = [p for p in programs if d in p.devices]
        memory[d] = DeviceMemory(
            device=d, stage=stage, params=held.params.get(d, 0), optimizer=held.optimizer.get(d, 0),
            batch=held.batch.get(d, 0), stashed=stashed.get(d, 0),
            temp=max((p.temp_bytes for p in mine), default=0),
            outputs=max((p.output_bytes - p.alias_bytes for p in mine), default=0))
    result = Estimate(name=name, memory=memory, programs=programs, transfers=transfers, notes=_NOTES)
    if profile is None:
        return result
    programs = tuple(on_platform(p, profile) for p in programs)  # as the profile's platform runs them
    result = Estimate(name=name, memory=memory, programs=programs, transfers=transfers, notes=_NOTES)
    time = _step_time(plan, result, segment_program, profile, dtype, model_flops)
    return Estimate(name=name, memory=memory, programs=programs, transfers=transfers, profile=profile, time=time,
                    notes=(*_NOTES, _time_note(programs, time, profile)))


def _time_note(programs: tuple[ProgramCost, ...], time: StepTime, profile: HardwareProfile) -> str:
    """How the programs were timed: kernel by kernel, or one roofline each; their collectives beside the
    compute, or after it (`timing`)."""
    compiled = ", ".join(sorted({p.platform for p in programs})) or "an unknown platform"
    native = all(p.platform == profile.platform for p in programs) and bool(profile.platform)
    kernel_wise = all(t.kernels is not None for t in time.programs.values())
    if kernel_wise:
        model = (f"each program the sum of its kernels' rooflines (compiled for {compiled}, priced as "
                 f"{profile.platform}{'' if native else ': matrix products as library kernels'})")
    else:
        model = (f"one roofline per program (compiled for {compiled}, priced as "
                 f"{profile.platform or 'a profile of no platform'}: elementwise work fused into the products)")
    flash = ("; priced for another platform, a program's bytes leave out the attention scores a flash kernel "
             "keeps on chip" if any(p.attention_bytes for p in programs) and not native else "")
    rate = (f"; flops at {profile.achievable_matmul_fraction:.1%} of the peak, the measured achievable matmul "
            f"rate" if profile.achievable_matmul_fraction < 1 else "")
    overlap = ("beside the compute, except those between two matrix products" if overlaps_collectives(profile)
               else "after the compute")
    return (f"time: {model} + alpha-beta collectives, {overlap}{rate}; a pipeline through its schedule's "
            f"simulator, each stage with its own programs' costs (see multimesh.estimate.steptime){flash}")


def _step_time(plan: Any, est: Estimate, segment_program: dict[int, int] | None, profile: HardwareProfile,
               dtype: str | None, model_flops: float | None) -> StepTime:
    n_devices = len(est.memory)
    timing = step_timing(plan, est.programs, segment_program, est.transfers, profile, dtype, n_devices)
    total = timing.total
    by_dtype: dict[str, float] = {}
    at_peak = 0.0  # device-seconds the programs' flops take at peak, each at its dtype's rate
    for p in est.programs:
        runs = p.executions * len(p.devices)
        at_peak += compute_time(p, profile, dtype) * runs
        for d, f in p.matmul_dtypes:
            by_dtype[d] = by_dtype.get(d, 0.0) + f * runs
    flops = est.flops
    peak = flops / at_peak if at_peak > 0 else (profile.flops_rate(dtype) if dtype else
                                                rate_for(profile, main_dtype(by_dtype)))
    hfu = utilisation(flops, total, peak, n_devices, "the compiled programs' flops (HFU)")
    mfu = None if model_flops is None else utilisation(model_flops, total, peak, n_devices, "model_flops= (MFU)")
    return StepTime(programs=timing.programs, transfers=timing.transfers, total=total,
                    dtype=dtype_label(by_dtype, dtype), mfu=mfu, hfu=hfu, peak=peak, model_flops=model_flops,
                    pipeline=timing.pipeline, outside=timing.outside)
