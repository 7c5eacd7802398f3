"""``--plan --num-devices N --profile NAME``: a config's layout estimated on devices this machine may not have.

JAX fixes its number of CPU devices when it starts
(``--xla_force_host_platform_device_count``), so a plan for ``N`` devices
other than those present runs again in a fresh process with ``N`` simulated
CPU devices (``JAX_PLATFORMS=cpu``). There the config's train step is built
and compiled from abstract inputs (nothing is allocated) and its
:class:`multimesh.estimate.Estimate` printed: memory per device and, with a
profile, the predicted step time and MFU on that hardware.

XLA's compiler may crash on a program (a signal, in C++), ending that
process with no word. The parent names what the child was compiling when it
died and the signal (`multimesh.autolayout.compile_journal`); a candidate of
``layout.mesh=auto``'s search is set aside, listed unpriced, and the search
runs again without it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from multimesh.autolayout.compile_journal import JOURNAL_ENV, CompileJournal, Crash, compiling, signal_name
from trainers.config import Config, ConfigError

__all__ = ["SIMULATED", "crash_message", "estimate_config", "model_flops_of", "needs_other_devices", "print_estimate",
           "replan_on_simulated_devices", "simulated_env"]

#: Set in the process that plans on simulated devices, to the device count it was started with.
SIMULATED = "MULTIMESH_PLAN_SIMULATED_DEVICES"

_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def simulated_env(num_devices: int, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for a process with ``num_devices`` simulated CPU devices (any device count it set replaced)."""
    flags = _COUNT_FLAG.sub("", environ.get("XLA_FLAGS", "")).split()
    env = dict(environ)
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={num_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env[SIMULATED] = str(num_devices)
    return env


def needs_other_devices(num_devices: int) -> bool:
    """Whether this process's devices are not ``num_devices`` (starts JAX's backends)."""
    import jax

    have = jax.device_count()
    if have != num_devices and os.environ.get(SIMULATED):  # the re-run itself: JAX ignored the flag
        raise RuntimeError(f"started with {os.environ[SIMULATED]} simulated CPU devices "
                           f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}) but JAX has {have}")
    return have != num_devices


def replan_on_simulated_devices(argv: Sequence[str], num_devices: int) -> int:
    """``multimesh-train ARGV`` again, in a process with ``num_devices`` simulated CPU devices; its exit status
    (128 + the signal where it died by one, after saying what it was compiling). A layout search whose
    candidate's compile killed it runs again, that candidate set aside."""
    cmd = [sys.executable, "-m", "trainers", *argv]
    with tempfile.TemporaryDirectory(prefix="multimesh-compile-journal-") as tmp:
        journal = CompileJournal(Path(tmp))
        env = {**simulated_env(num_devices, os.environ), JOURNAL_ENV: tmp}
        while True:
            status = subprocess.run(cmd, env=env, check=False).returncode
            if status >= 0:
                return status
            known = journal.crashes()
            crash = journal.interrupted(-status)
            print(crash_message(crash, -status, num_devices), file=sys.stderr, flush=True)
            if crash is None or not crash.candidate or crash.what in known:  # known: set aside, yet it crashed
                return 128 - status


def crash_message(crash: Crash | None, signal_number: int, num_devices: int) -> str:
    """What to say when the process planning on ``num_devices`` simulated devices died by ``signal_number``
    (``crash``: what it was compiling)."""
    where = f"the planning process ({num_devices} simulated CPU devices)"
    if crash is None:
        return (f"multimesh-train: {where} was killed by {signal_name(signal_number)}, not while compiling a "
                f"program (out of memory? see dmesg); exit status {128 + signal_number}")
    if crash.candidate:
        return (f"multimesh-train: compiling the layout {crash.what} killed XLA's compiler ({crash.signal}) in "
                f"{where}: it is listed unpriced, and the search runs again without it")
    return (f"multimesh-train: compiling {crash.what} killed XLA's compiler ({crash.signal}) in {where}. Try "
            f"another layout (layout.mesh=..., or layout.mesh=auto: a search sets such layouts aside), the "
            f"versions multimesh is tested on (pip install -c requirements/lock.txt), or report it to XLA with "
            f"the program: XLA_FLAGS=--xla_dump_to=DIR")


def model_flops_of(cfg: Config) -> float:
    """One train step's model flops (`multimesh.estimate.model_flops`, for MFU): 6 x the parameters whose
    products the model runs (an untied input embedding is a lookup, not a product: left out) x the batch's
    tokens, plus attention over ``data.seq_len``; recomputation not counted."""
    import jax
    import numpy as np

    from multimesh.estimate import model_flops
    from trainers.step import build_model, initializers

    m = cfg.model
    init_params, _ = initializers(cfg, build_model(m), None)
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(init_params)))
    products = count - (0 if m.tie_embeddings else m.vocab_size * m.d_model)
    return model_flops(products, cfg.data.batch_size * cfg.data.seq_len, layers=m.num_layers,
                       seq_len=cfg.data.seq_len, attention_width=m.num_heads * m.head_dim)


def estimate_config(cfg: Config, profile: Any = None, devices: Sequence[Any] | None = None,
                    dtype: str | None = None) -> Any:
    """The `Estimate` of ``cfg``'s train step on its layout over ``devices`` (default: all), priced on
    ``profile`` (a name or `HardwareProfile`; None: memory and work only), each matrix product at the peak of
    the dtype it runs in, read from the program (``dtype``: all at that one's), with the model's flops for
    MFU (`model_flops_of`). Nothing is allocated."""
    from trainers.layout import build_layout
    from trainers.step import program_for

    program = program_for(cfg, devices)
    flops = model_flops_of(cfg) if profile is not None else None
    what = f"{cfg.name}'s train step, {build_layout(cfg.layout, devices).describe()}"
    with compiling(what, candidate=False):
        return program.step.estimate(profile=profile, dtype=dtype, model_flops=flops)


def print_estimate(cfg: Config, profile: str | None) -> None:
    """``--plan``'s estimate: which devices it assumed, then the `Estimate` table."""
    import jax

    n = jax.device_count()
    where = f"{n} simulated CPU devices" if os.environ.get(SIMULATED) else f"{n} {jax.devices()[0].platform} devices"
    used = cfg.layout.num_devices
    of = (f" (the layout uses {used} of them: the other {n - used} would sit idle; give layout.mesh for {n} "
          f"devices, or layout.mesh=auto to search layouts of all {n})") if used < n else ""
    priced = f", priced as {profile}" if profile else " (no --profile: memory and work only)"
    print(f"\nestimate of {cfg.name}'s train step on {where}{of}{priced}:")
    estimate = estimate_config(cfg, profile)
    print(estimate)
    print(_against_memory_limit(estimate))


def _against_memory_limit(estimate: Any) -> str:
    """Whether the estimate's peak per device fits ``MULTIMESH_MEMORY_LIMIT`` where it is set (it then
    stands for each device's memory, the profile's included), else that it could be set."""
    from multimesh.core.fmt import format_bytes
    from multimesh.estimate.memory import LIMIT_VARIABLE, parse_bytes

    text = os.environ.get(LIMIT_VARIABLE)
    if not text:
        return f"(set {LIMIT_VARIABLE}, e.g. {LIMIT_VARIABLE}=16GiB, to check the peak against a memory per device)"
    try:
        limit = parse_bytes(text)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    over = estimate.overflow(limit)
    if not over:
        return f"{LIMIT_VARIABLE}={text!r}: the peak per device fits in {format_bytes(limit)}"
    worst = max(over.values())
    return (f"{LIMIT_VARIABLE}={text!r}: the peak per device does NOT fit in {format_bytes(limit)}: devices "
            f"{sorted(over)} are over by up to {format_bytes(worst)} (a smaller layout.mesh per device, more "
            f"devices, or layout.mesh=auto with layout.memory_limit)")
