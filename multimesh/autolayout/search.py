"""`auto_layout`: try every layout of the devices, keep those that fit, rank them by predicted step time.

Each candidate (`layouts.enumerate_layouts`: meshes, rule sets, pipelines)
goes through the cheapest test that can reject it first: a mesh's other
rule sets come after its standard rules, and are not compiled where those
fit and are predicted at least `PRUNE_RATIO` times the best (they save
memory, not time); then the batch's shapes
(read once, `jax.eval_shape`) and the model's experts (an ``expert`` axis
must divide them), the names the step's arrays give their
dimensions (read from the first layout built: a mesh axis none of them can
be sharded over sets a layout aside unbuilt), the bytes those arrays need
per device at least on the layout's rules (`bounds`: over the memory limit,
set aside unbuilt), then the step built on it by
`parallelize` (traced and planned, not compiled): a mesh axis that shards nothing, a rule
set that changes nothing, or parameters, optimizer state and batch that alone
overflow the memory limit. Only the rest are compiled, from abstract inputs,
and estimated (`multimesh.estimate`): their peak memory per device against
the limit, and their predicted step time on the profile. With ``time_top=k``
the ``k`` best-predicted are then built for real and timed (`timing`), and
ranked first, by their measured step.

A candidate whose compile kills the process (XLA's compiler crashing) ends
the search with it; run under a parent that reads a `compile_journal`, the
search runs again, and a layout recorded as crashed is not compiled but
listed unpriced, with the signal (``multimesh-train --plan --num-devices N``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from ..core.fmt import format_bytes
from ..core.rules import PathRules, Rules, as_axes
from ..estimate import Estimate, HardwareProfile, get_profile, held_bytes
from ..estimate.report import bytes_per_device
from ..estimate.usable import usable_memory
from ..run.mesh_errors import MeshAxesError
from .bounds import HeldArrays
from .building import PipelineFactory, build_on, layout_rules
from .checks import (
    LeafNames,
    batch_misfit,
    expert_misfit,
    fsdp_as_data,
    idle_axis,
    idle_by_names,
    idle_rules,
    pipeline_misfit,
    shapes_of,
)
from .compile_journal import CompileJournal, Crash, compiling
from .layouts import AXES, RULE_SETS, ParallelLayout, enumerate_layouts
from .model_axes import AxisTypes, ModelNames, axes_made_explicit, model_names
from .table import search_table
from .timing import check_timing, time_layout

__all__ = ["Candidate", "LayoutSearch", "LayoutSearchError", "NoLayoutFitsError", "NoValidLayoutError",
           "auto_layout"]

#: Reasons a candidate is rejected that say it is no valid layout for the step (not that it is too big).
_INVALID = "invalid: "
#: The reason of a candidate whose compile killed a process before (`compile_journal`): valid, not priced.
_UNPRICED = "unpriced: "


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout tried: its `Estimate` (None when rejected before compiling), its peak bytes per device
    (the held bytes alone when rejected by them), predicted step ``time`` (s) and ``mfu``, why it was
    ``rejected`` (None: it fits), and its ``measured`` step (s; None: not timed, see ``time_top``)."""

    layout: ParallelLayout
    estimate: Estimate | None = None
    peak_bytes: int | None = None
    time: float | None = None
    mfu: float | None = None
    rejected: str | None = None
    measured: float | None = None
    #: hardware flop utilisation (the compiled programs' flops, recomputation included)
    hfu: float | None = None

    @property
    def valid(self) -> bool:
        """Whether the layout can serve the step at all (it may still be too big)."""
        return not (self.rejected or "").startswith(_INVALID)


@dataclasses.dataclass(frozen=True)
class LayoutSearch:
    """What `auto_layout` found: every ``candidates`` ranked (those timed by measured time, then those that
    fit by predicted time, then the rejected), the ``profile``, the per-device ``memory_limit``, the devices,
    how long it took, the mesh axes it made Explicit (None: as the mesh in context), and the rules given for
    the model's own logical names."""

    candidates: tuple[Candidate, ...]
    profile: HardwareProfile
    memory_limit: int
    num_devices: int
    seconds: float
    explicit_axes: frozenset[str] | None = None
    own_rules: Rules | None = None

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.rejected is None)

    @property
    def best(self) -> ParallelLayout:
        """The layout of the least measured step time among those timed (``time_top``), else of the least
        predicted among those that fit."""
        if not self.fitting:
            raise _nothing_fits(self)
        return self.fitting[0].layout

    @property
    def best_candidate(self) -> Candidate:
        if not self.fitting:
            raise _nothing_fits(self)
        return self.fitting[0]

    def __str__(self) -> str:
        return search_table(self)

    def __repr__(self) -> str:
        best = self.fitting[0].layout.describe() if self.fitting else "none fits"
        return f"LayoutSearch({len(self.candidates)} candidates, best: {best}, {self.seconds:.1f} s)"


class LayoutSearchError(ValueError):
    """No layout can be chosen; ``search`` holds every candidate and why it was rejected. The message names
    `auto_layout`'s arguments; `explain` words it for a caller that sets them under other names."""

    def __init__(self, search: LayoutSearch, words: Callable[[Callable[[str], str]], str]):
        self.search = search
        self._words = words
        super().__init__(self.explain())

    def explain(self, names: Mapping[str, str] | None = None) -> str:
        """The message, each `auto_layout` argument it advises changing (``memory_limit``, ``axes``,
        ``stage_counts``) called by ``names`` (e.g. ``{"memory_limit": "layout.memory_limit"}``)."""
        names = names or {}
        return self._words(lambda arg: f"{names.get(arg, arg)}=")


class NoLayoutFitsError(LayoutSearchError):
    """Valid layouts exist, and none fits the memory limit."""


class NoValidLayoutError(LayoutSearchError):
    """No layout of the devices suits the step (its batch, its model's dimensions)."""


def _nothing_fits(search: LayoutSearch) -> LayoutSearchError:
    valid = [(c, c.peak_bytes) for c in search.candidates if c.valid and c.peak_bytes is not None]
    if valid:
        # a whole peak estimated (a limit that suffices), else the least held bytes (a limit that does not)
        estimated = [(c, peak) for c, peak in valid if c.estimate is not None]
        least, peak = min(estimated or valid, key=lambda pair: pair[1])
        needs = f"{format_bytes(peak)} ({peak:,} B) per device"

        def fits(arg: Callable[[str], str]) -> str:
            if least.estimate is None:  # refused on its held bytes before its programs were compiled
                advice = (f"more than {needs}: that is its parameters, optimizer state and batch alone, and its "
                          f"programs' temporaries (not estimated) come on top. Raise {arg('memory_limit')} well "
                          f"above {peak:,}")
            else:
                advice = f"{needs}. Raise {arg('memory_limit')} to at least {peak:,}"
            return (f"auto_layout: no layout of {search.num_devices} devices fits the memory limit "
                    f"{format_bytes(search.memory_limit)} ({search.memory_limit:,} B) per device; the smallest "
                    f"found, {least.layout.describe()}, needs {advice}, use more devices, or shrink the model or "
                    f"the batch")

        return NoLayoutFitsError(search, fits)
    reasons: dict[str, list[str]] = {}
    for c in search.candidates:
        reasons.setdefault((c.rejected or "").removeprefix(_INVALID), []).append(c.layout.describe())
    why = "; ".join(f"{', '.join(ls)}: {r}" for r, ls in reasons.items())

    def invalid(arg: Callable[[str], str]) -> str:
        if all(r.startswith(_UNPRICED) for r in reasons):
            advice = ("XLA's compiler crashed on every layout it compiled: try another JAX (the versions of "
                      "multimesh's requirements/lock.txt are tested), or report the crash to XLA with the program "
                      "(XLA_FLAGS=--xla_dump_to=DIR)")
            return f"auto_layout: no layout of {search.num_devices} devices could be priced: {why}. {advice}"
        if all(r.startswith("cannot be built") for r in reasons):  # the step's own error, on every mesh alike
            advice = "No layout could be built; the step's error above says what to change"
        else:
            advice = (f"Use a device count whose factors divide the batch and the model's dimensions (e.g. a power "
                      f"of two), or other {arg('axes')}/{arg('stage_counts')}")
        return f"auto_layout: no valid layout of {search.num_devices} devices: {why}. {advice}"

    return NoValidLayoutError(search, invalid)


def _search_axes(axes: Sequence[str] | None, names: ModelNames) -> tuple[str, ...]:
    """The axes to factorize the devices over: ``axes``, checked, or by default data, fsdp, expert (for a model
    with experts: its parameters name an ``expert`` dimension) and tensor (or the model's ``model``) and the
    axes the model names itself (`model_axes`)."""
    model = names.axes
    experts = "expert" in names.sizes
    if axes is None:
        tensor = "model" if "model" in model else "tensor"
        default = ("data", "fsdp", *(("expert",) if experts else ()), tensor)
        return (*default, *(a for a in model if a not in default))
    axes = tuple(axes) if not isinstance(axes, str) else (axes,)
    unknown = [a for a in axes if a not in AXES and a not in model]
    if not axes or unknown or len(set(axes)) != len(axes):
        own = f"; the model's parameters name {', '.join(map(repr, model))}" if model else ""
        raise ValueError(f"auto_layout: axes={axes!r}; give distinct mesh axes among {AXES} (standard_rules gives "
                         f"each a role: data and fsdp split the batch, fsdp the parameters, expert a Mixture of "
                         f"Experts' experts, tensor/model the Megatron dimensions) or among those the model's "
                         f"parameters name themselves{own}")
    if "tensor" in axes and "model" in axes:
        raise ValueError("auto_layout: axes names both 'tensor' and 'model', which standard_rules treats as one "
                         "(tensor parallelism); keep one of them")
    if "expert" in axes and names.read and not experts and "expert" not in model:
        raise ValueError(f"auto_layout: axes={axes!r} names 'expert', but no parameter of the model has an "
                         f"'expert' dimension (it has no experts): the axis would split only the batch, as data "
                         f"does; leave it out")
    return axes


def _own_rules(rules: Sequence[tuple[str, Any]] | None, axes: tuple[str, ...], model: tuple[str, ...]) -> Rules | None:
    """``rules=`` checked: pairs naming only axes some mesh of the search has."""
    if rules is None:
        return None
    own = Rules(rules)
    for name, named in own:
        missing = [a for a in as_axes(named) if a not in axes and a not in model]
        if missing:
            raise ValueError(f"auto_layout: the rule ({name!r}, {named!r}) in rules= names mesh axis {missing[0]!r}, "
                             f"which no mesh of the search has (axes={axes!r}); name one of those, or search it "
                             f"with axes=")
    return own


def _pick_devices(devices: Sequence[Any] | None, num_devices: int | None) -> list[Any]:
    if devices is not None and num_devices is not None:
        raise TypeError("auto_layout: give devices= or num_devices=, not both")
    present = jax.devices()
    if devices is not None:
        return list(devices)
    n = len(present) if num_devices is None else num_devices
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"auto_layout: num_devices must be a positive int, got {num_devices!r}")
    if n > len(present):
        raise ValueError(f"auto_layout: num_devices={n}, but {len(present)} devices are present; plan for more "
                         f"on CPU by starting Python with XLA_FLAGS=--xla_force_host_platform_device_count={n} "
                         f"(JAX_PLATFORMS=cpu)")
    return present[:n]


def _progress(total: int, progress: bool | None, what: str = "auto_layout") -> Any:
    from tqdm import tqdm

    show = sys.stderr.isatty() if progress is None else progress
    return tqdm(total=total, desc=what, unit="layout", disable=not show, leave=False)


def auto_layout(step: Callable, *, init_params: Callable[[], Any], get_input_batch: Callable[[], Any],
                profile: str | HardwareProfile, devices: Sequence[Any] | None = None,
                num_devices: int | None = None, memory_limit: int | None = None,
                axes: Sequence[str] | None = None, axis_types: AxisTypes = None,
                rules: Sequence[tuple[str, Any]] | None = None,
                pipeline: PipelineFactory | None = None, stage_counts: Sequence[int] = (1,),
                microbatches: Sequence[int] = (4, 8), schedules: Sequence[str] = ("1f1b", "zb-h2"),
                rule_sets: Sequence[str] = RULE_SETS, progress: bool | None = None, time_top: int = 0,
                time_steps: int = 3, dtype: str | None = None, model_flops: float | None = None,
                param_rules: PathRules | dict | Iterable | None = None, batch_spec: tuple = ("batch",),
                donate: bool = False, strict: bool = False) -> LayoutSearch:
    """Search the layouts of ``step`` on the devices; return them ranked (`LayoutSearch`, print it).

    Args:
      step: the train step, as for `parallelize`.
      init_params: as for `parallelize`.
      get_input_batch: as for `parallelize`.
      profile: a `HardwareProfile` or a name (``"h100-sxm"``, ...) to predict step times with.
      devices: the devices to lay out (default: all).
      num_devices: instead of ``devices``, the first ``num_devices`` devices.
      memory_limit: bytes per device (default: what the runtime gives a step on the profile's devices,
        `multimesh.estimate.usable.usable_memory`: 75% of a GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION
        or MULTIMESH_MEMORY_LIMIT says otherwise).
      axes: the mesh axes whose sizes are searched (factorizations of the devices per stage). Default:
        data, fsdp and tensor, expert where the model's parameters have an ``expert`` dimension (a Mixture of
        Experts; sizes that do not divide its experts are listed invalid), and any the model's parameters
        name themselves (``nn.with_partitioning``, NNX sharding metadata; e.g. ``tp``), which every mesh tried
        has, of size 1 where it does not split them. Naming expert for a model without experts is an error.
      axis_types: ``"explicit"``: the axes the model names itself are Explicit (for code in JAX's
        explicit-sharding style, ``out_sharding=P(...)``), the others Auto (every searched axis Explicit when
        it names none); ``"auto"``: every axis Auto; default: the types of the mesh in context
        (``jax.set_mesh``) for the axes it names, Auto for the others.
      rules: rules for the model's own logical names, which `standard_rules` does not know (e.g.
        ``[("hidden", "tensor")]``), given before each rule set's; on a mesh without an axis a rule names,
        that dimension stays whole. Their mesh axes must be among the searched ones (``axes``).
      pipeline: ``pipeline(stages, chunks)`` -> a context manager that registers the model's parts on the
        stages (e.g. with ``register_task(..., callback=... stage_task(s))``); needed for stage counts > 1.
      stage_counts: pipeline stage counts to try (1: SPMD).
      microbatches: microbatch counts tried for every pipeline (the step must call `microbatch`).
      schedules: schedules tried for every pipeline.
      rule_sets: `named_rules` tried on every mesh (``"sequence"`` only where it has a tensor axis).
      progress: a progress bar (default: when stderr is a terminal).
      time_top: build the ``time_top`` best-predicted layouts that fit with the real initializers, one at a
        time, time ``time_steps`` steps of each (the median, after one to compile) on these devices, and rank
        them first by that: a measured choice among layouts the model predicts close to each other. Only on
        the profile's own kind of devices (a calibrated profile, or a datasheet one on its GPUs or TPUs).
      dtype: price every flop at this dtype's peak (default: each matrix product at the peak of the dtype
        its operands run in, read from each candidate's program).
      model_flops: one step's model flops (`multimesh.estimate.model_flops`), for each candidate's MFU;
        without it the table shows HFU only.
      param_rules: as for `parallelize`, for every layout built.
      batch_spec: as for `parallelize`.
      donate: as for `parallelize` (the layouts timed with ``time_top`` never donate).
      strict: as for `parallelize`.

    Raises `UnknownProfileError`, `TimingError` (``time_top=`` on devices not of the profile's kind), and a
    `LayoutSearchError` (`NoLayoutFitsError`, `NoValidLayoutError`)
    when no layout can be chosen.
    """
    start = time.perf_counter()
    profile = get_profile(profile)
    limit = usable_memory(profile).bytes if memory_limit is None else bytes_per_device(memory_limit, "auto_layout",
                                                                                       "memory_limit")
    if limit > profile.memory_bytes:
        warnings.warn(f"auto_layout: memory_limit={limit:,} B is above {profile.name}'s device memory "
                      f"({format_bytes(profile.memory_bytes)}, {profile.memory_bytes:,} B): a layout that fits it "
                      f"may not fit the device", stacklevel=2)
    named = model_names(init_params)
    model = named.axes
    axes = _search_axes(axes, named)
    explicit = axes_made_explicit(axis_types, model, axes)
    own = _own_rules(rules, axes, model)
    stage_counts = tuple(stage_counts)
    if any(not isinstance(s, int) or s < 1 for s in stage_counts) or not stage_counts:
        raise ValueError(f"auto_layout: stage_counts={stage_counts!r}; give positive ints (1: SPMD)")
    if pipeline is None and any(s > 1 for s in stage_counts):
        raise ValueError(f"auto_layout: stage_counts={stage_counts} tries pipelines, which need pipeline= "
                         f"(stages, chunks) -> a context registering the model's stages")
    parallelize_kwargs: dict[str, Any] = dict(param_rules=param_rules, batch_spec=batch_spec, donate=donate,
                                              strict=strict)
    pool = _pick_devices(devices, num_devices)
    check_timing(time_top, time_steps, profile, pool)
    batch_shapes = shapes_of(jax.eval_shape(get_input_batch))  # once for every candidate
    layouts = list(enumerate_layouts(len(pool), axes, stage_counts, tuple(microbatches), tuple(schedules),
                                     tuple(rule_sets), required=model))
    kwargs = dict(init_params=init_params, get_input_batch=get_input_batch, explicit_axes=explicit, own_rules=own,
                  **parallelize_kwargs)
    candidates: list[Candidate] = []
    journal = CompileJournal.from_env()
    crashed = {} if journal is None else journal.crashes()  # recorded by the parent of an earlier run
    built: _Built | None = None  # what the step's arrays are, once one layout is built
    experts = named.sizes.get("expert", frozenset())
    layouts.sort(key=lambda layout: layout.rules != "standard")  # each mesh's standard rules before its others
    with _progress(len(layouts), progress) as bar:
        for layout in layouts:
            candidate = _pruned(layout, candidates) or _crashed(layout, crashed)
            if candidate is None:
                candidate, built = _try(layout, step, pool, pipeline, limit, profile, kwargs, batch_shapes, built,
                                        axes, experts, {"dtype": dtype, "model_flops": model_flops})
            candidates.append(candidate)
            bar.update(1)
    ranked = _timed(sorted(candidates, key=_rank), time_top, time_steps, progress,
                    lambda layout: build_on(layout, step, pool, pipeline, quiet=True, **{**kwargs, "donate": False}))
    search = LayoutSearch(tuple(ranked), profile, limit, len(pool), time.perf_counter() - start, explicit, own)
    if not search.fitting:
        raise _nothing_fits(search)
    return search


def _timed(ranked: list[Candidate], top: int, steps: int, progress: bool | None,
           build: Callable[[ParallelLayout], Any]) -> list[Candidate]:
    """``ranked`` with its ``top`` best-predicted fitting candidates timed (`time_layout`) and ranked again."""
    chosen = [c for c in ranked if c.rejected is None][:top]
    if not chosen:
        return ranked
    timed = {}
    with _progress(len(chosen), progress, "timing") as bar:
        for c in chosen:
            with compiling(c.layout.describe(), candidate=True):
                measured = time_layout(functools.partial(build, c.layout), steps)
            timed[c.layout] = dataclasses.replace(c, measured=measured)
            bar.update(1)
    return sorted((timed.get(c.layout, c) for c in ranked), key=_rank)


def _rank(c: Candidate) -> tuple:
    """Timed by measured time, then fitting by predicted time, then too big by peak, then unpriced, then
    invalid; ties by description."""
    if c.measured is not None:
        return (-1, c.measured, c.peak_bytes, c.layout.describe())
    if c.rejected is None:
        return (0, c.time, c.peak_bytes, c.layout.describe())
    if (c.rejected or "").startswith(_UNPRICED):
        return (2, 0, 0.0, c.layout.describe())
    if c.valid:
        return (1, c.peak_bytes or 0, 0.0, c.layout.describe())
    return (3, 0, 0.0, c.layout.describe())


#: A layout whose standard-rules twin was priced at this many times the best fitting one or more is not compiled
#: with other rules: the ``sequence`` rules split the activations' length over the tensor axis, which saves
#: memory and moves the same bytes (a reduce-scatter and an all-gather for each all-reduce), so they gain at
#: most the elementwise work the twin repeats on every tensor device. Whether the twin fits does not matter:
#: the memory they save may make a layout fit, not make it faster.
PRUNE_RATIO = 1.25


def _pruned(layout: ParallelLayout, done: Sequence[Candidate]) -> Candidate | None:
    """``layout`` set aside uncompiled (`PRUNE_RATIO`), or None to try it."""
    if layout.rules == "standard":
        return None
    twin = dataclasses.replace(layout, rules="standard")
    fitting = [_predicted(c) for c in done if c.rejected is None]
    for c in done:
        if c.layout == twin and c.time is not None and fitting and c.time >= PRUNE_RATIO * min(fitting):
            fits = "fits and is" if c.rejected is None else "(too big) is"
            return Candidate(layout, rejected=f"not compiled: its standard-rules twin {fits} predicted "
                                              f"{c.time / min(fitting):.2f}x the best, and these rules save "
                                              f"memory, not time")
    return None


def _crashed(layout: ParallelLayout, crashed: Mapping[str, Crash]) -> Candidate | None:
    """``layout`` listed unpriced, uncompiled, where compiling it killed a process before; else None."""
    crash = crashed.get(layout.describe())
    if crash is None:
        return None
    return Candidate(layout, rejected=f"{_UNPRICED}compiling it killed XLA's compiler ({crash.signal}) in an "
                                      f"earlier run of this search")


def _predicted(c: Candidate) -> float:
    """The predicted step time of a fitting candidate (each was estimated, so it has one)."""
    if c.time is None:
        raise ValueError(f"auto_layout: the fitting layout {c.layout.describe()} has no predicted step time")
    return c.time


def _explicit_hint(error: Exception) -> str:
    """Advice when JAX refused the step's explicit-sharding code on a mesh of Auto axes (or none in context)."""
    text = str(error)
    if "of type Auto" not in text and "not under a mesh context" not in text:
        return ""
    return ("; the step's code uses JAX's explicit sharding (PartitionSpecs on Explicit mesh axes): pass "
            "axis_types='explicit', or search under jax.set_mesh of a mesh whose axes are Explicit")


def _over(limit: int, device: int, need: int, what: str) -> str:
    return (f"device {device} needs {format_bytes(need)} ({need:,} B){what}, {format_bytes(need - limit)} "
            f"({need - limit:,} B) over the limit {format_bytes(limit)}")


@dataclasses.dataclass(frozen=True)
class _Built:
    """What the first layout built tells of every other: the names the step's arrays give their dimensions, and
    those arrays' bytes (`bounds.HeldArrays`)."""

    names: LeafNames
    held: HeldArrays

    @classmethod
    def of(cls, step_fn: Any) -> _Built:
        return cls(LeafNames.of(step_fn), HeldArrays.of(step_fn))


def _try(layout: ParallelLayout, step: Callable, pool: list, pipeline: PipelineFactory | None, limit: int,
         profile: HardwareProfile, kwargs: dict, batch_shapes: list, built: _Built | None,
         axes: tuple[str, ...], experts: frozenset[int], pricing: dict) -> tuple[Candidate, _Built | None]:
    """One layout through the checks, cheapest first (see the module docstring); and what the step's arrays
    are (``built``, read from the first layout built). ``axes``: the searched ones; ``experts``: the sizes of
    the parameters' ``expert`` dimensions; ``pricing``: `estimate`'s ``dtype`` and ``model_flops``."""
    misfit = batch_misfit(layout, batch_shapes) or expert_misfit(layout, experts)
    rules = layout_rules(layout, kwargs["own_rules"])
    if misfit is None and built is not None:
        misfit = idle_by_names(layout, built.names, rules) or fsdp_as_data(layout, built.names, rules, axes)
    if misfit is not None:
        return Candidate(layout, rejected=_INVALID + misfit), built
    if built is not None:
        least = built.held.least_per_device(layout, rules)
        if least > limit:  # no need to build it: what it must hold alone does not fit
            return Candidate(layout, peak_bytes=least, rejected=_too_big_unbuilt(limit, least)), built
    try:
        step_fn = build_on(layout, step, pool, pipeline, quiet=True, **kwargs)[0]
    except Exception as e:  # the layout's own misfit, e.g. more stages than layers, a dimension that won't split
        if not isinstance(e, (ValueError, NotImplementedError)) and type(e).__name__ != "ShardingTypeError":
            raise
        # JAX's own error: a MeshAxesError's advice is for a mesh the user passes; the search's is below
        if isinstance(e, MeshAxesError) and isinstance(e.__cause__, Exception):
            e = e.__cause__
        why = f"{_INVALID}cannot be built: {type(e).__name__}: {e}{_explicit_hint(e)}"
        return Candidate(layout, rejected=why), built
    known = built is not None  # then fsdp_as_data was checked above, before building
    built = built or _Built.of(step_fn)
    names = built.names
    misfit = (pipeline_misfit(layout, step_fn) or idle_axis(layout, step_fn, rules, names)
              or (None if known else fsdp_as_data(layout, names, rules, axes)) or idle_rules(layout, step_fn))
    if misfit is not None:
        return Candidate(layout, rejected=_INVALID + misfit), built
    return _estimated(layout, step_fn, limit, profile, pricing), built


def _too_big_unbuilt(limit: int, least: int) -> str:
    """Why a layout is set aside unbuilt (`bounds`): the bytes it must hold per device alone overflow."""
    return (f"does not fit: at least {format_bytes(least)} ({least:,} B) per device of parameters, optimizer state "
            f"and batch, {format_bytes(least - limit)} ({least - limit:,} B) over the limit {format_bytes(limit)} "
            f"(read from its rules, not built)")


def _estimated(layout: ParallelLayout, step_fn: Any, limit: int, profile: HardwareProfile, pricing: dict) -> Candidate:
    """A built layout's candidate: refused on the bytes it holds, else compiled, estimated and checked."""
    held = held_bytes(step_fn.param_layout.leaves, step_fn.batch_layout.leaves)
    per_device = {d: held.params.get(d, 0) + held.optimizer.get(d, 0) + held.batch.get(d, 0)
                  for d in set(held.params) | set(held.optimizer) | set(held.batch)}
    device, most = max(per_device.items(), key=lambda kv: (kv[1], -kv[0]), default=(0, 0))
    if most > limit:  # no need to compile: what it holds alone does not fit
        return Candidate(layout, peak_bytes=most,
                         rejected=_over(limit, device, most, " for parameters, optimizer state and batch alone"))
    try:
        with compiling(layout.describe(), candidate=True):
            est = step_fn.estimate(profile=profile, **pricing)
    except (ValueError, NotImplementedError) as e:  # a layout the estimate cannot compile; the others still rank
        return Candidate(layout, rejected=f"{_INVALID}cannot be estimated: {type(e).__name__}: {e}")
    over = est.overflow(limit)
    rejected = None
    if over:
        device = max(over, key=lambda d: (over[d], -d))
        rejected = _over(limit, device, est.memory[device].peak, " at its peak")
    return Candidate(layout, est, est.peak_bytes, est.time.total, est.time.mfu, rejected, hfu=est.time.hfu)
