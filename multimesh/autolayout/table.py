"""The text table of a `LayoutSearch`: rank, layout, peak bytes per device, predicted (and measured) time, MFU
(model flops; '-' without them) and HFU (compiled flops), why rejected."""

from __future__ import annotations

from typing import Any

from ..core.fmt import format_bytes

__all__ = ["NEAR_THE_BEST", "search_table"]


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def search_table(search: Any) -> str:
    """The search as lines: a heading, then one row per candidate (the fitting ones ranked 1, 2, ...)."""
    fits = len(search.fitting)
    n = len(search.candidates)
    compiled = sum(c.estimate is not None for c in search.candidates)
    lines = [f"auto_layout: {n} layout{'s' if n != 1 else ''} of {search.num_devices} devices on "
             f"{search.profile.name}, memory limit {format_bytes(search.memory_limit)}/device: {fits} fit; "
             f"{compiled} compiled{', the others set aside as their rows say' if compiled < n else ''}; searched in "
             f"{search.seconds:.1f} s"]
    timed = any(c.measured is not None for c in search.candidates)
    rows = [("rank", "layout", "peak/device", "predicted", *(("measured",) if timed else ()), "MFU", "HFU",
             "rejected")]
    for i, c in enumerate(search.candidates, 1):
        peak = "-" if c.peak_bytes is None else format_bytes(c.peak_bytes)
        if c.estimate is None and c.peak_bytes is not None:
            peak = ">" + peak  # the held bytes alone: the peak is more
        mfu = "-" if c.mfu is None else f"{c.mfu:.1%}"
        hfu = "-" if c.hfu is None else f"{c.hfu:.1%}"
        rows.append((str(i) if c.rejected is None else "-", c.layout.describe(), peak, _time(c.time),
                     *((_time(c.measured),) if timed else ()), mfu, hfu, c.rejected or ""))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]) - 1)]
    for r in rows:
        cells = [r[0].rjust(widths[0]), r[1].ljust(widths[1]), *(x.rjust(w) for x, w in zip(r[2:-1], widths[2:])),
                 r[-1]]
        lines.append("  ".join(cells).rstrip())
    resharding = [f"{c.layout.describe()} ({len(c.estimate.reshards)})" for c in search.candidates
                  if c.estimate is not None and c.estimate.reshards]
    if resharding:
        lines.append(f"note: XLA reshards arrays by gathering them whole on every device (its 'involuntary full "
                     f"rematerialization' warning) in {', '.join(resharding)}; print a candidate's estimate for "
                     f"which arrays")
    close = _near_the_best(search)
    if close > 1 and search.profile.alone_speedup > 1 and not timed:
        near = f"{NEAR_THE_BEST - 1:.0%}"
        lines.append(f"note: these devices share their host's cores, where layouts predicted within {near} of each "
                     f"other have measured in either order (benchmarks/RESULTS.md, planner): time the {close} "
                     f"predicted within {near} of the best to choose among them (auto_layout(..., time_top={close}))")
    return "\n".join(lines)


#: predicted times this close to the best are ties on a host whose devices share cores
NEAR_THE_BEST = 1.10


def _near_the_best(search: Any) -> int:
    """How many fitting layouts are predicted within `NEAR_THE_BEST` of the best."""
    times = [c.time for c in search.fitting]
    return sum(1 for t in times if t <= min(times) * NEAR_THE_BEST) if times else 0
