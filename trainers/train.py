"""The training loop: data, parallel step, validation, metrics, checkpoints, resume.

``train(config)`` runs ``config.train.steps`` optimizer steps on the config's
layout and writes to ``config.out_dir``:

* ``metrics.jsonl``: one line per logged step: ``step``, ``loss`` (mean train
  loss since the previous line), ``lr``, ``grad_norm``, ``tokens_per_s``,
  ``wall_time`` (seconds of training so far, set-up and compilation
  included; a resumed run goes on from its checkpoint's line), for a
  Mixture-of-Experts model ``moe_aux_loss`` (its load-balancing loss, 1 when
  even), and ``val_loss`` when computed; the progress bar shows the same mean loss
  (``mean_loss``), and its rate and ETA leave out the first step's compilation;
* ``tensorboard/``: the same numbers as TensorBoard scalars (``train.tensorboard``;
  ``trainers.observe``), and in both ``step_time_s`` (mean seconds per step since
  the previous line) and, with ``layout.profile``, ``mfu`` (the model's flops over
  that hardware's peak);
* ``profile/`` (with ``train.profile_steps: [a, b]``): a ``jax.profiler`` trace of
  steps ``a`` to ``b`` (TensorBoard's profile plugin, Perfetto), and for a
  pipeline its schedule beside it (``schedule.png``, ``schedule.txt``);
* ``loss.png``: the loss curves against the unigram baseline (at the end),
  titled with every layout the run used;
* ``checkpoints/<step>/``: asynchronous, every ``checkpoint_every`` steps and at the
  end: the train state, the data position, the config and the layouts as metadata;
* ``config.yaml`` (the resolved config), ``sharding.txt`` (where each array
  lives), ``summary.json`` (the final numbers, the process count and devices; like
  ``metrics.jsonl``, strict JSON: a NaN is ``null``);
* ``schedule.png`` (pipeline layouts): the schedule's timeline, stages x time,
  a box per forward/backward pass of each microbatch, the bubbles empty.

If ``out_dir`` holds a checkpoint (and ``train.resume``), the run continues
from the latest one, onto the current layout: the same config gives the same
result, bit for bit, whether or not it was interrupted.

Two ways a run ends early, both leaving only committed checkpoints of finite states:

* a NaN or infinite loss, gradient norm or parameter raises ``NonFiniteError``
  (``train.on_nonfinite=stop``, the default; ``warn`` warns and goes on),
  naming the step and the last checkpoint (``trainers.nonfinite``);
* SIGTERM or SIGINT: the current step finishes, is checkpointed, and
  ``Preempted`` is raised (``trainers.preemption``).
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from models.transformer import count_params
from multimesh.checkpoint import CheckpointCorruptError, CheckpointManager, Restored
from trainers.config import Config, ConfigError, config_from_dict
from trainers.config_diff import changed_keys, describe_changes, yaml_value
from trainers.continuation import continue_schedule, optimizer_changes
from trainers.data import TextDataset, load_corpus, make_datasets
from trainers.feed import Feed
from trainers.fit import check_data, check_memory, make_out_dir
from trainers.layout import build_layout, pipeline_schedule, write_schedule_png
from trainers.layout_search import resolve_auto_layout
from trainers.metrics import MetricsLog, StepBar, Throughput, plot_losses, read_metrics, strict_json
from trainers.nonfinite import NonFiniteError, NonFiniteWarning, first_nonfinite, how_to_fix
from trainers.observe import ProfileWindow, Scalars, model_flops_utilisation
from trainers.optim import cut_warmup_note
from trainers.preemption import Preempted, StopSignals
from trainers.run_lock import hold_out_dir
from trainers.step import Program, build_program

__all__ = ["SYNC_EVERY", "TrainResult", "built_line", "sharding_text", "train"]

#: Block on the step's results at least this often: bounds the executions in flight
#: (XLA:CPU aborts when ~50 collectives are queued) and keeps the progress bar honest.
SYNC_EVERY = 4


@dataclasses.dataclass
class TrainResult:
    """What a run did. ``losses`` maps each step run by this call to its train loss."""

    config: Config
    out_dir: Path
    start_step: int
    step: int
    losses: dict[int, float]
    val_loss: float | None
    baseline: float
    wall_time: float
    tokens_per_s: float
    state: Any = dataclasses.field(repr=False)

    def summary(self) -> str:
        if self.val_loss is None:
            verdict = "no validation loss"
        else:
            verdict = (f"final validation loss {self.val_loss:.4f} vs unigram baseline {self.baseline:.4f} "
                       f"nats/byte ({self.val_loss - self.baseline:+.4f})")
        steps = self.step - self.start_step
        resumed = f" (resumed at {self.start_step})" if self.start_step else ""
        rate = "n/a" if math.isnan(self.tokens_per_s) else f"{self.tokens_per_s:,.0f}"
        return f"{verdict}; {steps} steps{resumed} in {self.wall_time:.1f} s wall, {rate} tokens/s"


def validation_steps(val: TextDataset, num_batches: int) -> list[int]:
    """``num_batches`` batch indices spread evenly over the validation split (all of it if fewer)."""
    n = val.steps_per_epoch
    return sorted({k * n // num_batches for k in range(num_batches)}) if num_batches < n else list(range(n))


def validate(program: Program, params: Any, val: Feed, num_batches: int) -> float:
    """Mean validation loss over ``num_batches`` batches spread over the validation split."""
    losses, pending = [], []
    for s in validation_steps(val.dataset, num_batches):
        pending.append(program.evaluate(params, val.at(s)))
        if len(pending) >= SYNC_EVERY:
            losses += [float(x) for x in jax.device_get(pending)]
            pending = []
    losses += [float(x) for x in jax.device_get(pending)]
    return float(np.mean(losses))


def _resume_point(ckpt: CheckpointManager, cfg: Config,
                  corrupt: list[CheckpointCorruptError]) -> tuple[int | None, dict | None]:
    """The checkpoint step to resume from (None: start afresh): the newest whose manifest reads (the
    errors of newer ones are added to ``corrupt``), and the config saved with it (plain data, None if
    absent); refuses an incompatible one."""
    steps = ckpt.all_steps()
    if not steps:
        return None, None
    if not cfg.train.resume:
        raise ConfigError(f"{ckpt.directory} already holds checkpoints {steps} and "
                          f"train.resume is false; use another train.out_dir or delete it")
    for latest in reversed(steps):
        try:
            metadata = ckpt.info(latest).metadata
            break
        except CheckpointCorruptError as e:
            corrupt.append(e)
    else:
        raise corrupt[0]
    saved = metadata.get("config") if isinstance(metadata, dict) else None
    if isinstance(saved, dict):
        try:
            old = config_from_dict(saved)
        except ConfigError:
            return latest, saved  # written by another version of the trainer: the restore checks shapes
        changes = [c for section in ("model", "data") for c in changed_keys(getattr(old, section),
                                                                           getattr(cfg, section), section)]
        if changes:
            overrides = " ".join(shlex.quote(f"{key}={yaml_value(a)}") for key, a, _ in changes)
            raise ConfigError(
                f"{ckpt.step_path(latest)} was written with other model/data settings: {describe_changes(changes)} "
                f"(saved -> now); resume with the saved ones ({overrides}) or use another train.out_dir"
            )
    return latest, saved if isinstance(saved, dict) else None


def _restore_newest_intact(ckpt: CheckpointManager, latest: int, target: Any,
                           corrupt: list[CheckpointCorruptError], main: bool) -> Restored:
    """Step ``latest`` restored onto ``target``, else the newest older step that restores. Once one
    does, each corrupt step after it (``corrupt``, and those found here) is set aside, with a line on
    stderr naming it, so that the run saves those steps afresh; when none restores, the newest step's
    `CheckpointCorruptError` is raised and nothing is moved."""
    for step in [s for s in reversed(ckpt.all_steps()) if s <= latest]:
        try:
            restored = ckpt.restore(step, target=target)
        except CheckpointCorruptError as e:
            corrupt.append(e)
            continue
        for e in corrupt:
            aside = ckpt.set_aside(e.step)
            if main:
                print(f"multimesh-train: {e} Resuming from step {step}, the newest intact one; step {e.step} "
                      f"is moved to {aside}", file=sys.stderr, flush=True)
        return restored
    raise corrupt[0]


def _layouts_so_far(ckpt: CheckpointManager, latest: int | None, current: str) -> list[str]:
    """Every layout the run has used, oldest first, ``current`` last: a resumed run reads the others from its
    checkpoint (one written before this was recorded gives its own ``layout``)."""
    before: list[str] = []
    if latest is not None:
        metadata = ckpt.info(latest).metadata
        if isinstance(metadata, dict):
            before = list(metadata.get("layouts") or ([metadata["layout"]] if "layout" in metadata else []))
    return before if before[-1:] == [current] else [*before, current]


def built_line(program: Program, seconds: float) -> str:
    """How long tracing and planning the step took (its programs compile in its first call), with a
    pipeline's program calls a step (they grow with its microbatches): what a user waits for before the
    first step is not left unexplained."""
    plan, runtime = getattr(program.step, "plan", None), getattr(program.step, "runtime", None)
    pipelined = runtime is not None and getattr(plan, "schedule", None) is not None
    calls = f" ({len(runtime.calls)} program calls a step)" if pipelined else ""  # fewer than actions if grouped
    return f"step built in {seconds:.1f} s{calls}; its programs compile in the first step"


def _log(quiet: bool, message: str) -> None:
    if not quiet:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stdout)


def sharding_text(program: Program) -> str:
    """What ``sharding.txt`` holds: where each parameter and batch array lives (a pipeline: on which
    stage), and for a pipeline its MPMD plan (an SPMD step's one-segment plan says nothing more)."""
    step = program.step
    plan = f"\n\n{step.plan}" if program.layout.is_pipeline else ""
    return f"{step.report()}\n\n{step.report(batch=True)}{plan}\n"


def _write_run_files(out: Path, program: Program, sharding: str) -> None:
    (out / "sharding.txt").write_text(sharding)
    (out / "config.yaml").write_text(program.config.to_yaml())
    pipeline = program.layout.pipeline
    if pipeline is not None:
        write_schedule_png(pipeline, out / "schedule.png")
        if program.config.train.profile_steps:  # the schedule beside the trace of its steps
            (out / "profile").mkdir(exist_ok=True)
            write_schedule_png(pipeline, out / "profile" / "schedule.png")
            (out / "profile" / "schedule.txt").write_text(f"{pipeline_schedule(pipeline)}\n")


def processes_line() -> str:
    """The header's line on the run's processes and devices."""
    n, here = jax.process_count(), jax.local_device_count()
    where = f"{jax.device_count()} {jax.devices()[0].platform} devices"
    if n == 1:
        return f"processes: 1 (process 0); {where}"
    return f"processes: {n} (this is process {jax.process_index()}); {where}, {here} on this process"


def profile_dir(out: Path) -> Path:
    """Where this process writes its profiler trace: ``profile/``, or with several processes
    ``profile/process_<i>/`` (processes on one host would name their files alike)."""
    if jax.process_count() == 1:
        return out / "profile"
    return out / "profile" / f"process_{jax.process_index()}"


def _mfu_basis(cfg: Config) -> tuple[float, float, int] | None:
    """``(model flops per step, peak flop/s per device, devices)`` for MFU with ``layout.profile`` at the
    model's compute dtype; None without a profile (or one without a peak for that dtype)."""
    if not cfg.layout.profile:
        return None
    from multimesh.estimate import get_profile
    from trainers.plan_estimate import model_flops_of

    try:
        peak = get_profile(cfg.layout.profile).flops_rate(cfg.model.dtype)
    except ValueError:
        return None
    return model_flops_of(cfg), peak, cfg.layout.num_devices


def train(cfg: Config, *, devices: Any = None, quiet: bool = False, stop_after: int | None = None,
          report: bool = False) -> TrainResult:
    """Run (or resume) training as configured; see the module doc for what is written.

    ``devices``: where the layout runs (default ``jax.devices()``).
    ``report``: print ``sharding.txt`` (where every array lives) once the step is built, before training
    (even when ``quiet``).
    ``stop_after``: leave after this step without the final checkpoint,
    validation or plot (as if killed; for tests).

    Raises ``NonFiniteError`` at the first non-finite loss, gradient norm or
    parameter (with ``train.on_nonfinite=stop``), and ``Preempted`` after
    checkpointing the step during which SIGTERM or SIGINT arrived.

    With several processes (``jax.distributed``), every process runs this on the
    same config and ``out_dir``; process 0 alone shows progress and writes the
    metrics, plot and summary (checkpoints are written by all).

    One run per ``out_dir``: another run holding it raises ``DirectoryInUseError``
    naming it (``run_lock``), and a checkpoint that fails to save raises
    ``CheckpointSaveError`` at the next step.
    """
    with hold_out_dir(cfg.out_dir):
        return _train(cfg, devices=devices, quiet=quiet, stop_after=stop_after, report=report)


def _train(cfg: Config, *, devices: Any, quiet: bool, stop_after: int | None, report: bool) -> TrainResult:
    t_start = time.perf_counter()
    main = jax.process_index() == 0
    quiet = quiet or not main
    out = make_out_dir(cfg.out_dir)
    cfg = resolve_auto_layout(cfg, devices, log=lambda text: _log(quiet, text))  # layout.mesh: auto
    layout = build_layout(cfg.layout, devices)
    # The corpus found may be smaller than data.max_bytes (which the config check assumed).
    check_data(cfg.data, layout.batch_ways, len(load_corpus(cfg.data.paths, cfg.data.max_bytes)))
    train_ds, val_ds, baseline = make_datasets(cfg.data, batch_multiple=layout.batch_ways)

    with CheckpointManager(out / "checkpoints", max_to_keep=cfg.train.keep) as ckpt, \
            layout.tasks(cfg.model.num_layers, cfg.model.scan_layers):
        corrupt: list[CheckpointCorruptError] = []  # steps that cannot be restored, newest first
        latest, saved = _resume_point(ckpt, cfg, corrupt)
        cfg = continue_schedule(cfg, saved)  # a resumed run continues the schedule it started
        t_build = time.perf_counter()
        program = build_program(cfg, layout, train_ds.batch_at(0), val_ds.batch_at(0))
        built_s = time.perf_counter() - t_build
        train_feed, val_feed = Feed(train_ds, program.step), Feed(val_ds, program.evaluate)
        if main:
            sharding = sharding_text(program)
            _write_run_files(out, program, sharding)
            if report:  # before the first step compiles, so that a layout is judged without waiting
                print(sharding, file=sys.stdout, flush=True)
        n_params = count_params(program.abstract_state["params"])
        check_memory(program.abstract_state, n_params, len(devices) if devices is not None else jax.device_count())
        _log(quiet, f"config {cfg.name}: {cfg.model.num_layers} layers, d_model {cfg.model.d_model}, "
                    f"{n_params / 1e6:.2f}M parameters, {cfg.model.dtype}; {layout.describe()}")
        _log(quiet, processes_line())
        _log(quiet, f"data: {len(train_ds.tokens):,} train / {len(val_ds.tokens):,} validation bytes, "
                    f"batch {cfg.data.batch_size} x {cfg.data.seq_len}; unigram baseline {baseline:.3f} nats/byte")
        _log(quiet, built_line(program, built_s))
        layouts = _layouts_so_far(ckpt, latest, layout.describe())
        if latest is None:
            state, start = program.init(), 0
            _log(quiet, f"writing to {out}")
            cut = cut_warmup_note(cfg.optimizer, cfg.optimizer.decay_steps)
            if cut is not None:
                _log(quiet, cut)
        else:
            restored = _restore_newest_intact(ckpt, latest, program.abstract_state, corrupt, main)
            state, start = restored.state, restored.step
            train_ds.load_state_dict(restored.data_position)
            if train_ds.step != start:
                raise RuntimeError(f"checkpoint {latest}: data position {train_ds.step} does not match its step")
            _log(quiet, f"resumed from {ckpt.step_path(start)}")
            changed = optimizer_changes(saved, cfg) if saved is not None else []
            if changed:
                _log(quiet, f"resumed with other optimizer settings than the checkpoint's: {', '.join(changed)}")
        state, losses, val_loss, clock, last = _loop(program, state, start, train_feed, val_feed, ckpt, out,
                                                     quiet, stop_after, t_start, layouts)
    wall = time.perf_counter() - t_start
    result = TrainResult(cfg, out, start, last, losses, val_loss, baseline, wall, clock.rate, state)
    if main and (stop_after is None or last >= cfg.train.steps):
        plot_losses(read_metrics(out / "metrics.jsonl"), out / "loss.png", baseline=baseline,
                    title=f"{cfg.name}: {', then '.join(layouts)}")
        (out / "summary.json").write_text(strict_json({
            "config": cfg.name, "layout": layout.describe(), "start_step": start, "step": last,
            "val_loss": val_loss, "unigram_baseline": baseline, "wall_time_s": round(wall, 2),
            "tokens_per_s": None if math.isnan(clock.rate) else round(clock.rate, 1),
            "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len,
            "num_processes": jax.process_count(), "process_id": jax.process_index(),
            "num_devices": jax.device_count(), "platform": jax.devices()[0].platform,
        }, indent=1) + "\n")
    return result


class _Loop:
    """The steps of one run: dispatch, bounded syncs, validation, metrics lines, checkpoints."""

    def __init__(self, program: Program, train: Feed, val: Feed, ckpt: CheckpointManager,
                 log: MetricsLog, bar: Any, t_start: float, layouts: list[str], scalars: Scalars,
                 profile: ProfileWindow):
        self.program, self.train, self.val, self.ckpt, self.log, self.bar = program, train, val, ckpt, log, bar
        self.scalars, self.profile = scalars, profile
        self._mfu_basis = _mfu_basis(program.config)
        cfg = program.config
        self.tc = cfg.train
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        # ``layouts``: every layout the run used, in order (a resumed run adds its own)
        self.metadata = {"config": cfg.to_dict(), "layout": program.layout.describe(), "layouts": layouts}
        self.losses: dict[int, float] = {}
        self.val_loss: float | None = None
        self.clock = Throughput()
        self._pending: list[tuple[int, Any]] = []
        self._window: list[float] = []
        self._grad_norm = float("nan")
        self._aux_loss = float("nan")
        self._t0 = t_start - log.resumed_wall_time  # wall_time goes on from where the resumed run stopped
        self._warned_nonfinite = False

    def run(self, state: Any, start: int, stop_after: int | None, signals: StopSignals) -> tuple[Any, int]:
        """Steps ``start+1 .. train.steps`` (or up to ``stop_after``); returns ``(state, last step)``.

        Every step waited for (``_sync``) is checked for non-finite values, and a
        checkpoint step is always waited for before it is saved. A stop signal
        (``signals``) ends the loop after the step it arrived in (its validation and
        scheduled save included; several processes: the next sync point), with a
        checkpoint of that step.
        """
        tc, last = self.tc, start
        for step in range(start + 1, tc.steps + 1):
            self.ckpt.poll()  # a failed background save stops the run here, not at the next save
            self.profile.started(step)
            with self.profile.step(step):
                metrics, state = self.program.step(state, next(self.train))
            self._pending.append((step, metrics))
            last = step
            is_last = step == tc.steps
            do_eval = step % tc.eval_every == 0 or is_last
            do_log = step % tc.log_every == 0 or do_eval
            do_ckpt = bool(tc.checkpoint_every and step % tc.checkpoint_every == 0) or is_last
            at_sync = (len(self._pending) >= SYNC_EVERY or do_log or do_ckpt or step == start + 1
                       or step == self.profile.last)
            if at_sync:
                self._sync()
            self.profile.finished(step, state)  # the trace ends with its last step's work
            if step == start + 1:  # the first step compiled the programs: the rate and the ETA start after it
                self.bar.time_from(step)
            if stop_after is not None and step >= stop_after and not is_last:
                break
            if do_eval or do_ckpt:
                self.clock.pause()
            if do_eval:
                self.val_loss = validate(self.program, state["params"], self.val, tc.eval_batches)
                self.bar.set_postfix(mean_loss=self._window_mean(), val=f"{self.val_loss:.3f}",
                                     tok_s=self.clock.format())
            if do_log:
                self._write(step, with_val=do_eval)
            if do_ckpt:
                self.ckpt.save(step, state, metadata=self.metadata, data_position=self.train.dataset.state_dict())
            if do_eval or do_ckpt:
                self.clock.resume()
            signum = signals.agreed(at_sync)
            if signum is not None:
                self._preempted(signum, step, state, signals.by, logged=do_log, saved=do_ckpt)
        self._sync()
        return state, last

    def _sync(self) -> None:
        """Wait for the dispatched steps, record their metrics, and check them for non-finite values."""
        if not self._pending:
            return
        fetched = jax.device_get([m for _, m in self._pending])
        steps = [step for step, _ in self._pending]
        for step, m in zip(steps, fetched):
            self.losses[step] = float(m["loss"])
            self._window.append(self.losses[step])
        self._grad_norm = float(fetched[-1]["grad_norm"])
        self._aux_loss = float(fetched[-1]["moe_aux_loss"])
        self.clock.count(len(self._pending) * self.tokens_per_step)
        step = self._pending[-1][0]
        self._pending.clear()
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(mean_loss=self._window_mean(), tok_s=self.clock.format(), refresh=False)
        bad = first_nonfinite(zip(steps, fetched))
        if bad is not None:
            self._nonfinite(*bad, synced=step)

    def _window_mean(self) -> str:
        """The mean train loss since the last metrics line: what the next line (and the plot) will show."""
        return f"{np.mean(self._window):.3f}" if self._window else "-"

    def _nonfinite(self, step: int, problem: str, synced: int) -> None:
        """``train.on_nonfinite``: warn once and go on, or stop before anything non-finite is saved."""
        if self.tc.on_nonfinite == "warn":
            if not self._warned_nonfinite:
                self._warned_nonfinite = True
                warnings.warn(f"non-finite values at step {step} ({problem}); training goes on as "
                              f"train.on_nonfinite=warn (checkpoints may hold them)", NonFiniteWarning, stacklevel=2)
            return
        self._write(synced, with_val=False)  # the losses up to here, NaN as null
        # a save still in flight holds a state checked finite at its step: let it commit, then name it
        self.ckpt.wait_until_finished()
        latest = self.ckpt.latest_step()
        checkpoint = None if latest is None else f"step {latest} ({self.ckpt.step_path(latest)})"
        opt = self.program.config.optimizer
        raise NonFiniteError(step, problem, checkpoint, how_to_fix(opt.lr, opt.clip_norm))

    def _speed(self, rate: float) -> dict[str, float | None]:
        """``step_time_s`` at ``rate`` tokens/s (None before any timed step), and ``mfu`` with a profile."""
        step_time = self.tokens_per_step / rate if rate > 0 else float("nan")
        speed: dict[str, float | None] = {"step_time_s": None if math.isnan(step_time) else round(step_time, 6)}
        if self._mfu_basis is not None:
            mfu = model_flops_utilisation(self._mfu_basis[0], step_time, *self._mfu_basis[1:])
            speed["mfu"] = None if mfu is None else float(f"{mfu:.4g}")
        return speed

    def _preempted(self, signum: int, step: int, state: Any, by: str, *, logged: bool, saved: bool) -> None:
        """Check, log and save ``step`` (unless done as scheduled), wait for the commit, raise ``Preempted``."""
        self._sync()  # checked before it is saved
        self.clock.pause()
        if not logged:
            self._write(step, with_val=False)
        if not saved:
            self.ckpt.save(step, state, metadata=self.metadata, data_position=self.train.dataset.state_dict())
        self.ckpt.wait_until_finished()
        raise Preempted(signum, step, self.ckpt.step_path(step), by)

    def _write(self, step: int, with_val: bool) -> None:
        rate = self.clock.window_rate()
        record = {
            "step": step,
            "loss": float(np.mean(self._window)),
            "lr": float(self.program.lr_schedule(step - 1)),
            "grad_norm": self._grad_norm,
            "tokens_per_s": None if math.isnan(rate) else round(rate, 1),
            "wall_time": round(time.perf_counter() - self._t0, 3),
        }
        if self.program.config.model.num_experts:  # the load-balancing loss of the last step synced (1: even)
            record["moe_aux_loss"] = self._aux_loss
        if with_val:
            record["val_loss"] = self.val_loss
        record.update(self._speed(rate))
        self.log.write(record)
        self.scalars.write(record)
        self._window.clear()


def _loop(program: Program, state: Any, start: int, train: Feed, val: Feed, ckpt: CheckpointManager, out: Path,
          quiet: bool, stop_after: int | None, t_start: float, layouts: list[str]):
    tc = program.config.train
    bar = StepBar(total=tc.steps, initial=start, desc=program.config.name, unit="step", disable=quiet,
               dynamic_ncols=True, file=sys.stdout, smoothing=0.1)
    main = jax.process_index() == 0
    log = MetricsLog(out / "metrics.jsonl", resume_at=start if start else None, write=main)
    scalars = Scalars(out / "tensorboard", resume_at=start if start else None, write=main and tc.tensorboard)
    profile = ProfileWindow(tc.profile_steps, profile_dir(out))
    if tc.profile_steps and start >= tc.profile_steps[1]:
        _log(quiet, f"train.profile_steps={tc.profile_steps}: this run starts after step {start}; nothing is traced")
    try:
        with log, scalars, StopSignals() as signals:
            loop = _Loop(program, train, val, ckpt, log, bar, t_start, layouts, scalars, profile)
            state, last = loop.run(state, start, stop_after, signals)
    finally:
        profile.stop()  # a run that ended inside the window keeps what it traced
        bar.close()
    if profile.written is not None:
        _log(quiet, f"profile of steps {tc.profile_steps[0]}..{tc.profile_steps[1]}: {profile.written} "
                    f"(tensorboard --logdir {out}, or open its perfetto_trace.json.gz at ui.perfetto.dev)")
    if start >= tc.steps:  # nothing left to train: report where the run stands
        _log(quiet, f"already trained to step {start} (train.steps={tc.steps}); raise train.steps to continue, "
                    f"or give a new train.out_dir to start over")
        loop.val_loss = validate(program, state["params"], val, tc.eval_batches)
    return state, loop.losses, loop.val_loss, loop.clock, last
