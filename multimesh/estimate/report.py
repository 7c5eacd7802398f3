"""`Estimate`: memory per device, work and predicted time of a step, as one object with a table."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from ..core.fmt import device_span, format_bytes
from .compiler_log import Reshard
from .profiles import HardwareProfile
from .programs import ProgramCost
from .timing import ProgramTime
from .trust import band_text, estimate_kind
from .usable import usable_memory

__all__ = ["DeviceMemory", "Estimate", "MemoryLimitError", "StepTime"]


class MemoryLimitError(ValueError):
    """No memory limit to check against: neither given nor from a profile."""


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes on one device: the step inputs' shards (exact, from the layouts), the stashed activations at
    the schedule's peak, and the largest of its programs' temporaries and outputs (XLA's analysis).

    ``peak = params + optimizer + batch + stashed + max over its programs of (outputs - aliased + temporaries)``.
    """

    device: int
    stage: str
    params: int
    optimizer: int
    batch: int
    stashed: int
    temp: int
    outputs: int

    @property
    def held(self) -> int:
        return self.params + self.optimizer + self.batch

    @property
    def peak(self) -> int:
        return self.held + self.stashed + self.outputs + self.temp


def bytes_per_device(value: object, where: str, name: str) -> int:
    """``value``, a memory limit given as argument ``name`` of ``where``, as whole bytes per device; a number of
    at least 1, else an error naming both."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a number of bytes per device (e.g. 80 * 2**30), got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and number >= 1):
        raise ValueError(f"{where}: {name} must be a positive number of bytes per device, got {value!r}")
    return int(value) if isinstance(value, numbers.Integral) else int(number)


@dataclass(frozen=True)
class StepTime:
    """The predicted step in seconds: per program one execution's `ProgramTime`, the copies between stages,
    the total; for a pipeline also its schedule's simulated makespan (``pipeline``) and the busiest stage's
    work outside the schedule (``outside``: the optimizer update, glue)."""

    programs: dict[str, ProgramTime]
    transfers: float
    total: float
    #: the dtypes the products were priced in (read from the programs), or the override asked for
    dtype: str
    #: model flop utilisation: ``model_flops`` over the peak for the step (None: no model flops given)
    mfu: float | None
    #: hardware flop utilisation: the compiled programs' flops (recomputation included) over the same peak
    hfu: float = 0.0
    #: flop/s per device at peak for the step's mix of dtypes (its flops over their time at each one's peak)
    peak: float = 0.0
    model_flops: float | None = None
    pipeline: float = 0.0
    outside: float = 0.0

    @property
    def utilisation(self) -> str:
        """``MFU x% (model flops), HFU y% (compiled flops)``, or HFU alone without model flops."""
        hfu = f"HFU {self.hfu:.1%} (compiled flops, recomputation included)"
        if self.mfu is None:
            return f"{hfu}; MFU: pass model_flops="
        return f"MFU {self.mfu:.1%} (model flops), {hfu}"

    def __repr__(self) -> str:
        mfu = "" if self.mfu is None else f"MFU {self.mfu:.1%}, "
        parts = [f"{self.total * 1e3:.4g} ms", f"{mfu}HFU {self.hfu:.1%} ({self.dtype})",
                 f"{len(self.programs)} program{'s' * (len(self.programs) != 1)}"]
        if self.pipeline:
            parts.append(f"pipeline {self.pipeline * 1e3:.4g} ms + outside {self.outside * 1e3:.4g} ms")
        if self.transfers:
            parts.append(f"copies {self.transfers * 1e3:.4g} ms")
        return f"StepTime({', '.join(parts)})"


@dataclass(frozen=True)
class Estimate:
    """What a step needs per device and how long it should take, without running it.

    ``memory``: a `DeviceMemory` per device id; ``programs``: each compiled
    program's `ProgramCost` (per device of its mesh); ``transfers``: bytes
    copied between stages per step, ``(what, from segment, to segment,
    bytes)``; ``time``: a `StepTime` when a profile was given. Print it for
    the table.
    """

    name: str
    memory: dict[int, DeviceMemory]
    programs: tuple[ProgramCost, ...]
    transfers: tuple[tuple[str, int, int, int], ...] = ()
    profile: HardwareProfile | None = None
    time: StepTime | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def peak_bytes(self) -> int:
        """The most any one device needs."""
        return max((m.peak for m in self.memory.values()), default=0)

    @property
    def flops(self) -> float:
        """Flops of one step, all devices together (XLA's count for the compiled programs)."""
        return sum(p.flops * p.executions * len(p.devices) for p in self.programs)

    def overflow(self, memory_bytes: int | None = None) -> dict[int, int]:
        """Per device that does not fit in ``memory_bytes`` (default: the profile's memory), the bytes over."""
        limit = self._limit(memory_bytes)
        return {d: m.peak - limit for d, m in self.memory.items() if m.peak > limit}

    def fits(self, memory_bytes: int | None = None) -> bool:
        """Whether every device's peak fits in ``memory_bytes`` (default: the memory the runtime gives a step
        on the profile's devices, `usable.usable_memory`)."""
        return not self.overflow(memory_bytes)

    def verdict(self, memory_bytes: int | None = None) -> str:
        """``fits`` or ``does not fit``, the limit and where it comes from, and the headroom (or the excess)."""
        limit = self._limit(memory_bytes)
        why = "as given" if memory_bytes is not None else usable_memory(self.profile).why  # type: ignore[arg-type]
        room = limit - self.peak_bytes
        head = (f"fits: peak {format_bytes(self.peak_bytes)} of {format_bytes(limit)} per device ({why}), "
                f"headroom {format_bytes(room)} ({room / limit:.0%})" if room >= 0 else
                f"does not fit: peak {format_bytes(self.peak_bytes)} is {format_bytes(-room)} over "
                f"{format_bytes(limit)} per device ({why})")
        return head

    def _limit(self, memory_bytes: int | None) -> int:
        if memory_bytes is not None:
            return bytes_per_device(memory_bytes, f"estimate of {self.name!r}", "memory_bytes")
        if self.profile is None:
            raise MemoryLimitError(f"estimate of {self.name!r}: fits() needs memory_bytes= or an estimate made "
                                   f"with a profile (estimate(step, profile='h100-sxm')) for its device memory")
        return usable_memory(self.profile).bytes

    def step_time_with_band(self) -> str:
        """``1.17 s (validation: within ±25% for data/FSDP on GPUs ...)``: the predicted step and how far the
        planner's validation against published runs trusts that kind of layout (`trust`)."""
        if self.time is None or self.profile is None:
            return "no predicted step time: estimate with a profile"
        total = self.time.total
        shown = f"{total:.3g} s" if total >= 1 else f"{total * 1e3:.3g} ms"
        return f"{shown} ({band_text(self.profile.platform, estimate_kind(self))})"

    @property
    def reshards(self) -> tuple[tuple[str, Reshard], ...]:
        """(program name, `Reshard`) for each array XLA warned, while compiling, that it reshards by gathering
        it whole on every device ("involuntary full rematerialization"): a collective the layout did not ask
        for, counted in the programs' costs, and a sign that a layout or a sharding constraint could avoid it."""
        return tuple((p.name, r) for p in self.programs for r in p.reshards)

    def collectives(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(kind, mesh axes) -> (count, bytes) per step, over every program and its executions."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for p in self.programs:
            for c in p.collectives:
                n, b = out.get((c.kind, c.axes_label), (0, 0))
                out[(c.kind, c.axes_label)] = (n + c.count * p.executions, b + c.bytes * c.count * p.executions)
        return out

    def __repr__(self) -> str:
        text = f"Estimate({self.name}, peak {format_bytes(self.peak_bytes)}/device, {self.flops:.3g} flops in all"
        if self.time is not None and self.profile is not None:
            text += f", {self.time.total * 1e3:.3g} ms on {self.profile.name}"
        return text + ")"

    def __str__(self) -> str:
        b = format_bytes
        lines = [f"Estimate of {self.name}: memory per device"]
        head = ("device", "stage", "params", "optimizer", "batch", "stashed", "outputs", "temp", "peak")
        same: dict[tuple, list[int]] = {}  # devices with equal rows share one line
        for d, m in sorted(self.memory.items()):
            same.setdefault((m.stage, b(m.params), b(m.optimizer), b(m.batch), b(m.stashed), b(m.outputs),
                             b(m.temp), b(m.peak)), []).append(d)
        rows = [head] + [(device_span(ds), *row) for row, ds in same.items()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append("programs (per device, one execution):")
        for p in self.programs:
            t = f", {self.time.programs[p.name].total * 1e3:.3g} ms" if self.time is not None else ""
            kernels = f"{sum(k.count for k in p.kernels)} kernels, " if p.kernels else ""
            scores = f" ({b(int(p.attention_bytes))} of it attention scores)" if p.attention_bytes else ""
            lines.append(f"  {p.name} x{p.executions} on {len(p.devices)} devices: {p.flops:.4g} flops per device, "
                         f"{b(p.bytes_accessed)} accessed{scores}, temp {b(p.temp_bytes)}, {kernels}"
                         f"{len(p.collectives)} collective{'s' * (len(p.collectives) != 1)}{t}")
        coll = self.collectives()
        if coll:
            lines.append("collectives per step (count, bytes per device):")
            for (kind, axes), (n, nbytes) in sorted(coll.items()):
                lines.append(f"  {kind} over {axes}: {n}, {b(nbytes)}")
        else:
            lines.append("collectives per step: none")
        if self.transfers:
            lines.append(f"between stages: {len(self.transfers)} copies, "
                         f"{b(sum(t[3] for t in self.transfers))} per step")
        if self.time is not None and self.profile is not None:
            parts = (f" (pipeline {self.time.pipeline * 1e3:.4g} ms + outside it {self.time.outside * 1e3:.4g} ms)"
                     if self.time.pipeline else "")
            lines.append(f"predicted step time on {self.profile.name} ({self.time.dtype}): "
                         f"{self.time.total * 1e3:.4g} ms{parts}, {self.time.utilisation}")
            lines.append(f"  {self.step_time_with_band()}")
        if self.profile is not None:
            lines.append(f"memory: {self.verdict()}")
        if self.reshards:
            lines.append(f"XLA reshards {len(self.reshards)} array{'s' * (len(self.reshards) != 1)} by gathering it "
                         f"whole on every device (its 'involuntary full rematerialization' warning):")
            lines += [f"  {name}: {r.describe()}" for name, r in self.reshards]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
