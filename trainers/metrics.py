"""Training metrics: a JSONL log (one line per logged step) and a loss-curve PNG.

Both JSON outputs of a run (``metrics.jsonl`` and ``summary.json``) are strict
JSON (:func:`strict_json`): a NaN or infinite number is written as ``null``.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
import time
from pathlib import Path
from typing import Any, Self

import numpy as np
from tqdm import tqdm

from multimesh._compat.tqdm import restart_clock

__all__ = ["MetricsLog", "StepBar", "Throughput", "plot_losses", "read_metrics", "strict_json"]


def _finite_or_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x


def strict_json(obj: Any, **kwargs: Any) -> str:
    """``json.dumps(obj)`` with every NaN or infinite float (also NumPy's) as ``null``: strict JSON,
    which ``json.dumps`` alone is not (it writes a bare ``NaN``)."""
    return json.dumps(_finite_or_none(obj), allow_nan=False, **kwargs)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file (an unfinished last line is ignored)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a kill
    return out


class MetricsLog:
    """Appends one JSON object per line to ``path``, flushed at once.

    ``resume_at`` (the step a run resumes from) drops the records of later
    steps, written by a run that died after its last checkpoint;
    ``resumed_wall_time`` is then the ``wall_time`` of the last record kept, from
    which the resumed run's clock goes on. With ``write=False`` (a process other
    than the first) nothing is written.
    """

    def __init__(self, path: str | os.PathLike, resume_at: int | None = None, *, write: bool = True):
        self.path = Path(path)
        self._file = None
        self.resumed_wall_time = 0.0
        if not write:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_at is None:
            self.path.write_text("")
        else:
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_at]
            self.path.write_text("".join(strict_json(r) + "\n" for r in kept))
            self.resumed_wall_time = float(kept[-1].get("wall_time") or 0.0) if kept else 0.0
        self._file = open(self.path, "a")  # noqa: SIM115 - open for the run, closed by close()

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(strict_json(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsLog({str(self.path)!r})"


class Throughput:
    """Tokens per second of training only: timed from the first :meth:`count` (so the first
    step's compilation is excluded), with :meth:`pause`/:meth:`resume` around other work."""

    def __init__(self) -> None:
        self.total = 0.0
        self.tokens = 0
        self.window_time = 0.0
        self.window_tokens = 0
        self._mark: float | None = None

    def resume(self) -> None:
        self._mark = time.perf_counter()

    def pause(self) -> None:
        self._mark = None

    def count(self, tokens: int) -> None:
        """``tokens`` were processed since the last mark (the first call only starts the clock)."""
        now = time.perf_counter()
        if self._mark is not None:
            dt = now - self._mark
            self.total += dt
            self.tokens += tokens
            self.window_time += dt
            self.window_tokens += tokens
        self._mark = now

    def window_rate(self) -> float:
        """Tokens/s since the previous call."""
        rate = self.window_tokens / self.window_time if self.window_time > 0 else float("nan")
        self.window_time, self.window_tokens = 0.0, 0
        return rate

    @property
    def rate(self) -> float:
        """Tokens/s over all timed steps."""
        return self.tokens / self.total if self.total > 0 else float("nan")

    def format(self) -> str:
        """The overall rate for display (``-`` before any timed step)."""
        return "-" if math.isnan(self.rate) else f"{self.rate:,.0f}"


class StepBar(tqdm):
    """tqdm's bar whose clock can restart at a step (`time_from`), so that its rate and ETA leave out the
    first step, which compiles the programs (tqdm's own ``reset`` would show step 0 meanwhile)."""

    def time_from(self, step: int) -> None:
        if self.disable:
            return
        restart_clock(self, step)
        self.refresh()


def plot_losses(records: list[dict[str, Any]], path: str | os.PathLike, *, baseline: float | None = None,
                title: str = "") -> Path:
    """Train and validation loss against step (and the unigram baseline) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss (mean since the previous point)", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5, ms=4)
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1, label=f"unigram baseline ({baseline:.2f})")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # a short run: whole steps, not 2.5
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(textwrap.fill(title, 90), fontsize=9)  # a long title (the layouts of a resumed run) wraps
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
