"""Watching a run: TensorBoard scalars of every metrics line, and a profiler trace of chosen steps.

* `Scalars` writes each ``metrics.jsonl`` record as TensorBoard scalars (``tensorboardX``'s event
  writer) under ``out_dir/tensorboard/``: ``train/loss``, ``train/learning_rate``, ``train/grad_norm``,
  ``perf/tokens_per_s``, ``perf/step_time_s``, ``perf/mfu`` (with ``layout.profile``) and ``val/loss``.
  ``tensorboard --logdir out_dir`` shows them; a resumed run drops the points after its checkpoint.
* `ProfileWindow` traces steps ``a`` to ``b`` of ``train.profile_steps: [a, b]`` with
  ``jax.profiler`` into ``out_dir/profile/``: an XPlane file that TensorBoard's profile plugin opens
  and a ``perfetto_trace.json.gz`` that https://ui.perfetto.dev opens, each step marked by a
  ``StepTraceAnnotation``; a pipeline's schedule (its timeline as ``--plan`` draws it) is written beside.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import jax

__all__ = ["TAGS", "ProfileWindow", "Scalars", "model_flops_utilisation"]

#: metrics record key -> TensorBoard tag
TAGS = {
    "loss": "train/loss",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "mfu": "perf/mfu",
    "val_loss": "val/loss",
}


class Scalars:
    """A metrics record per logged step as TensorBoard scalars in ``directory``; nothing where ``write`` is
    false (a process other than the first, or ``train.tensorboard: false``).

    ``resume_at``: the step a resumed run starts from; TensorBoard's reader drops the points a run that died
    after its last checkpoint wrote past it (the writer's ``purge_step``), as ``metrics.jsonl`` does. A run
    that starts afresh (None) in a directory of an earlier one drops all of that one's points.
    """

    def __init__(self, directory: str | Path, resume_at: int | None = None, *, write: bool = True):
        self.directory = Path(directory)
        self._writer = None
        if write:
            try:
                from tensorboardX import SummaryWriter
            except ModuleNotFoundError as e:
                raise ModuleNotFoundError(f"train.tensorboard is on, but {e.name} is not installed: pip install "
                                          f"tensorboardX (a dependency of multimesh: pip install -e . installs it), "
                                          f"or set train.tensorboard=false") from e
            self._writer = SummaryWriter(str(self.directory), purge_step=(resume_at or 0) + 1, flush_secs=10,
                                         filename_suffix=_event_file_suffix(self.directory))

    def write(self, record: dict[str, Any]) -> None:
        """The record's numbers (``null``, NaN and infinities left out) under their `TAGS`, at its ``step``."""
        if self._writer is None:
            return
        for key, tag in TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(tag, float(value), global_step=record["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> Scalars:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _event_file_suffix(directory: Path) -> str:
    """A suffix for a new event file that keeps it from another's name and sorts it after them.

    tensorboardX names an event file by the second it is opened in and the host
    (``events.out.tfevents.<second>.<host>``) and opens it for writing afresh: a run resumed within
    the same second (in the same process) would empty the earlier run's file. TensorBoard reads a
    directory's event files in name order, and the newer file's purge step must come last.
    """
    taken = list(directory.glob(f"events.out.tfevents.{str(time.time())[:10]}.*"))
    return f".{len(taken):03d}" if taken else ""


def model_flops_utilisation(model_flops: float, step_time_s: float, peak_flops: float, devices: int) -> float | None:
    """MFU of a measured step: the model's flops over the devices' peak for ``step_time_s`` (None without a
    time). Not capped: a value above 1 says the profile is not these devices'."""
    if not step_time_s > 0 or peak_flops <= 0 or devices <= 0:
        return None
    return model_flops / (step_time_s * peak_flops * devices)


class ProfileWindow:
    """``jax.profiler`` traces of steps ``first`` to ``last`` (``train.profile_steps``) into ``directory``.

    `step` marks each step of the window for TensorBoard's step view; `started` and `finished` bracket the
    window: the trace starts before step ``first`` is dispatched and stops once step ``last``'s results,
    waited for, are ready.
    """

    def __init__(self, steps: list[int] | None, directory: str | Path):
        self.first, self.last = (steps[0], steps[1]) if steps else (None, None)
        self.directory = Path(directory)
        self.tracing = False
        self.written: Path | None = None  # the trace's folder, once stopped

    def covers(self, step: int) -> bool:
        return self.first is not None and self.last is not None and self.first <= step <= self.last

    def started(self, step: int) -> None:
        """Before step ``step`` is dispatched: start tracing at the window's first step (a run resumed inside
        the window: at its first step)."""
        if self.covers(step) and not self.tracing and self.written is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.tracing = True

    def step(self, step: int) -> Any:
        """The context around one step's dispatch: an annotation inside the window, else nothing."""
        import contextlib

        if self.tracing:
            return jax.profiler.StepTraceAnnotation("train", step_num=step)
        return contextlib.nullcontext()

    def finished(self, step: int, state: Any) -> None:
        """After step ``step``: at the window's last, wait for ``state`` and stop tracing."""
        if self.tracing and step == self.last:
            self.stop(state)

    def stop(self, state: Any = None) -> None:
        """Stop a trace in progress (the run ended inside the window), waiting for ``state`` first."""
        if not self.tracing:
            return
        if state is not None:
            jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.tracing = False
        traces = sorted(self.directory.glob("plugins/profile/*"), key=lambda p: p.stat().st_mtime)
        self.written = traces[-1] if traces else self.directory
