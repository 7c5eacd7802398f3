"""``multimesh-train``: train the example transformer from a config, or sample from a run.

    multimesh-train [CONFIG] [key.sub=value ...]     train (CONFIG: a name in configs/ or a path; default tiny)
    multimesh-train sample --run DIR [--prompt TEXT] [--tokens N]

``python -m trainers`` is the same command. On CPU, 8 simulated devices are
created unless ``XLA_FLAGS`` already sets a device count.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multimesh.distributed import Launch

__all__ = ["main"]

SIMULATED_DEVICES = 8
#: the named configs (``trainers.config.CONFIG_DIR``, found here without importing JAX)
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def config_names() -> list[str]:
    """Every config of ``configs/``, by name."""
    return sorted(p.stem for p in CONFIGS.glob("*.yaml"))


_EPILOG = textwrap.dedent("""\
    configs (in configs/; the first lines of each file say what it is; default tiny):
    {configs}
    overrides: any key as section.key=value, the value parsed as YAML, e.g.
      train.steps=200  optimizer.lr=1e-3  layout.mesh='{data: 8}'  layout.pipeline=null
      model.dtype=bfloat16  train.out_dir=runs/try1
    exit status: 0 done, 2 a config error, 3 a NaN/inf loss, gradient norm or parameter
      (train.on_nonfinite=stop), 143/130 stopped by SIGTERM/SIGINT after checkpointing the
      current step (a second signal ends it at once); a run resumes where it stopped.
    outputs (train.out_dir, default runs/<config name>): metrics.jsonl, tensorboard/ (the same
      numbers as TensorBoard scalars: tensorboard --logdir runs), loss.png, checkpoints/,
      config.yaml, sharding.txt, summary.json, and schedule.png for a pipeline (the timeline
      of its schedule; --plan writes it without training); with train.profile_steps=[a,b] a
      jax.profiler trace of steps a..b in profile/ (TensorBoard, Perfetto). A run resumes from
      the latest checkpoint there. model.api=nnx trains the Flax NNX version of the same model.

    sampling: multimesh-train sample --run runs/tiny --prompt "def " --tokens 200
      (see multimesh-train sample --help)
    """)


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="multimesh-train",
        usage="multimesh-train [CONFIG] [key.sub=value ...] [--print-config] [--plan [--num-devices N] "
              "[--profile NAME]] [--report] [-q]\n"
              "       multimesh-train sample --run DIR [--prompt TEXT] [--tokens N] [...]",
        description="Train the example byte-level transformer on any parallel layout, by config.",
        epilog=_EPILOG.replace("{configs}", textwrap.fill(", ".join(config_names()), 88, initial_indent="  ",
                                                          subsequent_indent="  ")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]",
                   help="a config name (configs/NAME.yaml) or YAML path, then key.sub=value overrides")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--plan", action="store_true",
                   help="print the layout (a pipeline: the modules and parameter bytes of each stage, and its "
                        "schedule), write train.out_dir/schedule.png, exit; with layout.mesh=auto: the layout "
                        "search's table and the chosen layout's memory per device and predicted step time")
    p.add_argument("--num-devices", type=int, default=None, metavar="N",
                   help="with --plan: also estimate the layout's train step on N devices (simulated CPU devices, "
                        "in a fresh process, when this machine has another number): memory per device")
    p.add_argument("--profile", default=None, metavar="NAME",
                   help="with --plan: price that estimate on a hardware profile (h100-sxm, h200, b200, "
                        "a100-80gb, a100-40gb, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e): predicted step time and MFU")
    p.add_argument("--report", action="store_true",
                   help="print where every parameter and batch array lives (sharding.txt; a pipeline: on which "
                        "stage) before training starts")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or messages; only the summary")
    p.add_argument("--platform", choices=("any", "cpu", "gpu", "tpu"), default=None,
                   help="refuse to train unless JAX runs on this platform (default: $MULTIMESH_PLATFORM, else "
                        "$JAX_PLATFORMS where it names one, else any): a GPU node without CUDA JAX stops with "
                        "how to install it instead of training on CPU")
    multi = p.add_argument_group(
        "several processes",
        "one command per process, all with the same config and train.out_dir; on CPU each\n"
        "process gets 8/N simulated devices. Process 0 shows progress and writes the metrics.\n"
        "Under srun, mpirun (Open MPI), a Kubernetes indexed Job or a Cloud TPU pod no flag is\n"
        "needed: the launcher's variables say them; flags given win.")
    multi.add_argument("--coordinator", metavar="HOST:PORT",
                       help="address of process 0 (jax.distributed; default: the launcher's)")
    multi.add_argument("--num-processes", type=int, default=None, metavar="N",
                       help="processes in the run (default: the launcher's, else 1)")
    multi.add_argument("--process-id", type=int, default=None, metavar="I",
                       help="this process, 0..N-1 (default: the launcher's, else 0)")
    multi.add_argument("--startup-timeout", type=int, default=300, metavar="SECONDS",
                       help="how long to wait for every process to join (default 300); the missing ones are "
                            "named every 10 s, then the run stops with an error naming them")
    multi.add_argument("--run-id", default=None, metavar="NAME",
                       help="names this run, the same on each of its processes (default: $MULTIMESH_RUN_ID): "
                            "process 0 refuses processes of another run, so two runs given one --coordinator "
                            "port never join")
    multi.add_argument("--transfer-port", default=None, metavar="PORT|LOW-HIGH",
                       help="where this process receives pipeline stages' cross-host transfers: a port, or a "
                            "range of which it takes the first port free on its host, for clusters that open "
                            "only a fixed range between hosts (default: train.transfer_port, else any free port)")
    return p


def _sample_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="multimesh-train sample",
        description="Restore a run's latest checkpoint (on one device) and print generated text.",
    )
    p.add_argument("--run", required=True, help="the run directory (a train.out_dir, e.g. runs/tiny)")
    p.add_argument("--prompt", default="", help="text to continue (default: the start of a file)")
    p.add_argument("--tokens", type=int, default=200, help="bytes to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    return p


def _setup_devices(num_processes: int = 1) -> None:
    """Simulated CPU devices for the default layouts (must happen before JAX starts)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        count = max(1, SIMULATED_DEVICES // num_processes)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _launch(opts: argparse.Namespace) -> Launch | None:
    """This process's place in the run: the flags, with what they leave out from the launcher (srun,
    mpirun, ...); None for one process. Exits 2 naming the flags that contradict each other, or the
    launcher's variable that is wrong."""
    from multimesh.distributed import Launch, StartupError, find_launch

    if opts.num_processes is not None and opts.num_processes < 1:
        _usage_error(f"--num-processes must be >= 1, got {opts.num_processes}")
    if opts.startup_timeout < 1:
        _usage_error(f"--startup-timeout must be >= 1 (seconds), got {opts.startup_timeout}")
    if opts.transfer_port is not None:
        from multimesh.startup.ports import port_range

        try:
            port_range(opts.transfer_port, "--transfer-port")
        except ValueError as e:
            _usage_error(str(e))
    try:
        found = find_launch(timeout=opts.startup_timeout)
        if found is not None and (opts.coordinator, opts.num_processes, opts.process_id) != (None, None, None):
            found = find_launch(opts.coordinator, opts.num_processes, opts.process_id, timeout=opts.startup_timeout)
    except (StartupError, ValueError) as e:
        _usage_error(f"{type(e).__name__}: {e}")
    if found is not None:
        return found if found.num_processes > 1 else None
    n = 1 if opts.num_processes is None else opts.num_processes
    if opts.coordinator is not None and opts.num_processes is None:
        _usage_error(f"--coordinator {opts.coordinator} needs --num-processes N (how many processes the run has) "
                     f"and --process-id I on every process")
    if opts.process_id not in (None, 0) and opts.num_processes is None:
        _usage_error(f"--process-id {opts.process_id} needs --num-processes N and --coordinator HOST:PORT")
    if n > 1 and (opts.coordinator is None or opts.process_id is None or not 0 <= opts.process_id < n):
        _usage_error(f"--num-processes {n} needs --coordinator HOST:PORT and a --process-id in 0..{n - 1} "
                     f"(got {opts.coordinator}, {opts.process_id})")
    return None if n == 1 else Launch(opts.coordinator, n, opts.process_id)


def _usage_error(message: str) -> None:
    print(f"multimesh-train: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _start_processes(launch: Launch | None, cfg, startup_timeout: int, run_id: str | None,
                     transfer_port: str | None = None) -> None:
    """Join the other processes of the run (``jax.distributed``) and check that all were given the same
    config, ``out_dir`` and code, before anything is compiled; nothing for one process. ``transfer_port``
    (``--transfer-port``) wins over ``train.transfer_port``."""
    if launch is None:
        return
    import multimesh.distributed as dist

    # CPU collectives and cross-host transfers (pipeline stages on other processes)
    dist.initialize(launch.coordinator_address, launch.num_processes, launch.process_id,
                    local_device_ids=launch.local_device_ids, initialization_timeout=startup_timeout,
                    run_id=run_id, transfer_port=transfer_port or cfg.train.transfer_port)
    dist.agree("trainer config", _run_identity(cfg, launch.num_processes))


def _run_identity(cfg, num_processes: int) -> dict[str, object]:
    """What every process of a run must share: each config key (dotted), the resolved out_dir, the
    process count and the trainer's code."""
    from multimesh.startup.agreement import source_digest

    flat: dict[str, object] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = value

    walk("", cfg.to_dict())
    flat["train.out_dir (resolved)"] = str(cfg.out_dir)
    flat["--num-processes"] = num_processes
    flat["trainer source (sha256 of trainers/ and models/)"] = source_digest("trainers", "models")
    return flat


def _split_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    stray = [a for a in args if "=" not in a]
    if stray:
        raise SystemExit(f"multimesh-train: {stray[0]!r} is not key=value; the config name comes first")
    return None, list(args)


def _train(argv: Sequence[str]) -> int:
    opts = _train_parser().parse_intermixed_args(argv)
    if not opts.plan and (opts.num_devices is not None or opts.profile is not None):
        _usage_error("--num-devices and --profile go with --plan (they estimate the layout without training)")
    config_name, overrides = _split_args(opts.args)
    launch = _launch(opts)
    num_processes = 1 if launch is None else launch.num_processes
    _setup_devices(num_processes)
    from trainers.config import ConfigError, load_config

    if opts.plan and opts.profile is not None and not any(o.startswith("layout.profile=") for o in overrides):
        _check_profile_flag(opts.profile)
        overrides = [*overrides, f"layout.profile={opts.profile}"]  # --profile is the layout's (a search needs one)
    try:
        cfg = load_config(config_name, overrides)
    except ConfigError as e:
        print(f"multimesh-train: config error: {e}", file=sys.stderr)
        return 2
    if opts.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    if opts.plan:
        try:
            return _plan_and_estimate(opts, argv, cfg, num_processes)
        except ConfigError as e:
            print(f"multimesh-train: config error: {e}", file=sys.stderr)
            return 2
    from multimesh.distributed import DisagreementError, StartupError

    try:
        _start_processes(launch, cfg, opts.startup_timeout, opts.run_id, opts.transfer_port)
    except (StartupError, DisagreementError) as e:
        print(f"multimesh-train: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from trainers.platform_check import PlatformError, asked_platform, check_platform

    try:
        check_platform(*asked_platform(opts.platform))
    except PlatformError as e:
        print(f"multimesh-train: {e}", file=sys.stderr)
        return 2
    from trainers.nonfinite import EXIT_CODE as NONFINITE_EXIT
    from trainers.nonfinite import NonFiniteError
    from trainers.preemption import Preempted
    from trainers.run_lock import DirectoryInUseError
    from trainers.train import train

    try:
        result = train(cfg, quiet=opts.quiet, report=opts.report)
    except ConfigError as e:
        print(f"multimesh-train: config error: {e}", file=sys.stderr)
        return 2
    except DirectoryInUseError as e:  # another run holds train.out_dir
        print(f"multimesh-train: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"multimesh-train: error: {e}", file=sys.stderr)
        return NONFINITE_EXIT
    except Preempted as e:  # SIGTERM/SIGINT during training: the step is checkpointed
        print(f"multimesh-train: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside the training steps (setting up, the final validation)
        print("multimesh-train: interrupted (SIGINT) outside the training steps; the checkpoints already "
              "committed are kept", file=sys.stderr)
        return 130
    if launch is None or launch.process_id == 0:  # the others' numbers are the same
        print(result.summary())
    return 0


def _check_profile_flag(name: str) -> None:
    """Exits 2 naming ``--profile`` when ``name`` is no known hardware profile."""
    from multimesh.estimate import UnknownProfileError, get_profile

    try:
        get_profile(name)
    except UnknownProfileError as e:
        _usage_error(f"--profile {name}: {e}")


def _plan_and_estimate(opts: argparse.Namespace, argv: Sequence[str], cfg, num_processes: int) -> int:
    """``--plan``, then with ``--num-devices``, ``--profile`` or ``layout.profile`` the train step's estimate
    on those devices; ``--num-devices N`` other than the devices here re-runs the command with N simulated
    CPU devices. ``--profile`` overrides ``layout.profile``."""
    if opts.num_devices is not None:
        if opts.num_devices < 1:
            _usage_error(f"--num-devices must be >= 1, got {opts.num_devices}")
        if num_processes > 1:
            _usage_error(f"--num-devices plans on simulated devices in one process: drop --num-processes "
                         f"{num_processes} (and --coordinator, --process-id)")
    if opts.profile is not None:
        _check_profile_flag(opts.profile)
        if cfg.layout.profile and cfg.layout.profile.lower() != opts.profile.lower():
            print(f"(--profile {opts.profile} replaces layout.profile={cfg.layout.profile})")
        cfg = cfg.replace(layout={"profile": opts.profile})
    from trainers.plan_estimate import needs_other_devices, print_estimate, replan_on_simulated_devices

    if opts.num_devices is not None and needs_other_devices(opts.num_devices):
        return replan_on_simulated_devices(argv, opts.num_devices)
    status = _plan(cfg, num_processes, quiet=opts.quiet)
    if status == 0 and not cfg.layout.is_auto:
        if cfg.layout.profile or opts.num_devices is not None:
            print_estimate(cfg, cfg.layout.profile)
        else:
            print("(--profile NAME adds memory per device and the predicted step time on that hardware, e.g. "
                  "--profile h100-sxm; --num-devices N plans for N devices)")
    return status


def _plan(cfg, num_processes: int, quiet: bool = False) -> int:
    """``--plan``: the layout in words; for a pipeline its stages (modules, devices, parameter bytes) and
    its schedule, as text and as schedule.png.

    It checks the layout against this machine's devices (times ``num_processes``) and ``train.out_dir``
    first, as training would. A layout search shows a progress bar on a terminal unless ``quiet``.
    """
    import jax

    from trainers.fit import check_devices, check_out_dir, make_out_dir

    lay = cfg.layout
    if lay.is_auto:
        return _plan_auto(cfg, progress=False if quiet else None)
    check_devices(lay.mesh, lay.pipeline.stages if lay.pipeline else None, jax.local_device_count() * num_processes,
                  num_processes, more_devices="plan on that many simulated devices: --plan --num-devices {need}")
    check_out_dir(cfg.out_dir)
    mesh = "x".join(f"{k}={v}" for k, v in lay.mesh.items())
    if lay.pipeline is None:
        print(f"{cfg.name}: SPMD on {lay.num_devices} devices, mesh {mesh}, rules {lay.rule_pairs()}; no pipeline")
        return 0
    from trainers.layout import pipeline_schedule, write_schedule_png
    from trainers.stage_plan import format_stage_plan

    p = lay.pipeline
    print(f"{cfg.name}: {p.stages}-stage pipeline on {lay.num_devices} devices, stage mesh {mesh}, "
          f"{p.microbatches} microbatches\n{format_stage_plan(cfg)}\n{pipeline_schedule(p)}")
    path = make_out_dir(cfg.out_dir) / "schedule.png"
    write_schedule_png(p, path, title=None)
    print(f"wrote {path}")
    return 0


def _plan_auto(cfg, progress: bool | None = None) -> int:
    """``--plan`` of ``layout.mesh: auto``: the layout search's table, then the chosen layout's estimate
    (memory per device, programs, predicted step time). Nothing fits: the table, then the config error."""
    from trainers.errors import ConfigError
    from trainers.layout_search import search_layout

    try:
        search = search_layout(cfg, progress=progress)
    except ConfigError as e:
        if getattr(e, "search", None) is not None:  # every layout tried, and why none could be chosen
            print(e.search)
        raise
    best = search.best_candidate
    print(f"{search}\n\n{cfg.name}: chosen layout {best.layout.describe()}\n{best.estimate}")
    return 0


def _sample(argv: Sequence[str]) -> int:
    opts = _sample_parser().parse_args(argv)
    if opts.tokens < 0:
        raise SystemExit("multimesh-train sample: --tokens must be >= 0")
    _setup_devices()
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's notes about read-only mode
    from trainers.sample import sample_text

    text, ck = sample_text(opts.run, opts.prompt, opts.tokens, step=opts.step, temperature=opts.temperature,
                           top_k=opts.top_k or None, seed=opts.seed)
    print(f"# {ck.config.name}, checkpoint step {ck.step}", file=sys.stderr)
    print(opts.prompt + text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``multimesh-train`` and ``python -m trainers``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sample":
        return _sample(argv[1:])
    return _train(argv)


if __name__ == "__main__":
    sys.exit(main())
