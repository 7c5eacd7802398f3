"""``--platform gpu|tpu|cpu|any``: refuse to train on CPU when an accelerator was asked for.

A plain ``pip install`` on a GPU node installs JAX's CPU wheels, and the
trainer then runs, slowly, on simulated CPU devices. So before training
starts (after ``jax.distributed`` has joined the processes: asking for the
backend starts it) the platform JAX chose is checked against the one asked
for: ``--platform``, else ``$MULTIMESH_PLATFORM`` (the container sets
``gpu``), else ``$JAX_PLATFORMS`` where it names one platform, else ``any``.
A mismatch is an error that says how to install JAX for that platform
(docs/install.md). ``--plan`` is not checked: it plans on simulated devices.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

__all__ = ["ENV", "PLATFORMS", "PlatformError", "asked_platform", "check_platform"]

#: What may be asked for: JAX's platform names, with ``any`` (no check).
PLATFORMS = ("any", "cpu", "gpu", "tpu")
#: The environment variable read where ``--platform`` is not given.
ENV = "MULTIMESH_PLATFORM"
#: JAX_PLATFORMS's names, as the platform they ask for.
_JAX_NAMES = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}

_INSTALL = {
    "gpu": ("install JAX's CUDA wheels into this environment: pip install \".[cuda13]\" -c requirements/lock.txt "
            "(NVIDIA driver 580 or newer), or pip install \".[cuda12]\" (driver 525 or newer), from multimesh's "
            "clone; or run the container (Dockerfile). Check with python -c \"import jax; print(jax.devices())\" "
            "(docs/install.md)"),
    "tpu": ("install JAX's TPU wheels on the TPU VM: pip install \".[tpu]\" -c requirements/lock.txt -f "
            "https://storage.googleapis.com/jax-releases/libtpu_releases.html (docs/install.md)"),
    "cpu": "run with JAX_PLATFORMS=cpu (JAX then leaves the accelerators alone), or give --platform any",
}


class PlatformError(RuntimeError):
    """JAX runs on another platform than the one asked for (or cannot start that one)."""


def asked_platform(flag: str | None, environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """The platform asked for and who asked (``--platform gpu``, ``MULTIMESH_PLATFORM=gpu``,
    ``JAX_PLATFORMS=cuda``): ``flag``, else `ENV`, else ``JAX_PLATFORMS`` naming one platform, else ``any``."""
    if flag:
        asked, source = flag.strip().lower(), f"--platform {flag}"
    else:
        asked = environ.get(ENV, "").strip().lower()
        source = f"{ENV}={environ.get(ENV)}"
    if asked:
        if asked not in PLATFORMS:
            raise PlatformError(f"{source}: give one of {', '.join(PLATFORMS)}")
        return asked, source
    jax_platforms = environ.get("JAX_PLATFORMS", "")
    named = {_JAX_NAMES.get(p.strip().lower()) for p in jax_platforms.split(",") if p.strip()}
    if len(named) == 1 and None not in named:
        return str(named.pop()), f"JAX_PLATFORMS={jax_platforms}"
    return "any", ""


def check_platform(asked: str, source: str = "") -> str:
    """JAX's platform (``jax.default_backend()``), checked against ``asked`` (``source``: who asked, for the
    message); raises `PlatformError`."""
    import jax

    try:
        platform = jax.default_backend()
    except (RuntimeError, AssertionError) as e:  # JAX_PLATFORMS names a backend that cannot start (jax 0.12.1,
        # whose plugin is not installed: an AssertionError in jax's xla_bridge)
        detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise PlatformError(f"JAX cannot start the {asked} backend asked for ({source or asked}): {detail}. To run on "
                            f"{asked}, {_INSTALL.get(asked, 'see docs/install.md')}") from None
    if asked in ("any", platform):
        return platform
    found = ", ".join(sorted({str(d.device_kind) for d in jax.devices()}))
    why = ""
    if asked == "gpu" and _cuda_plugin_installed():
        why = (" JAX's CUDA plugin is installed but found no GPU: check nvidia-smi, CUDA_VISIBLE_DEVICES and "
               "the NVIDIA driver's version (580+ for cuda13 wheels, 525+ for cuda12);")
    raise PlatformError(f"asked to run on {asked} ({source or 'asked'}), but JAX runs on {platform} ({found}).{why} "
                        f"To run on {asked}, {_INSTALL[asked]}")


def _cuda_plugin_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))

