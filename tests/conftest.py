"""Test set-up: 8 simulated CPU devices and the persistent compilation cache.

Both must be configured before JAX initialises its backends, so this runs first.
"""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    str(pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"),
)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

NUM_DEVICES = 8


@pytest.fixture(autouse=True)
def _need_devices(request):
    need = request.node.get_closest_marker("devices")
    if need is not None and jax.device_count() < need.args[0]:
        pytest.skip(f"needs {need.args[0]} devices, have {jax.device_count()}")
