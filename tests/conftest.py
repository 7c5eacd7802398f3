"""Test set-up: 8 simulated CPU devices, XLA's cheap compilation and the persistent compilation cache.

All must be configured before JAX initialises its backends, so this runs first.

Compilation is most of the suite's time, and the suite's programs are tiny: XLA compiles them without its
expensive optimisations (``JAX_DISABLE_MOST_OPTIMIZATIONS``, inherited by the processes the tests start),
and the cache keeps every program, not only those slow to compile; together they take over a third off a
run on an empty cache. Every comparison is of programs compiled alike; a test whose claim rests on XLA's
optimised code generation (bit-equal values from differently sharded programs) is marked ``xla_optimized``
and compiles its own programs with the optimisations on. Set ``JAX_DISABLE_MOST_OPTIMIZATIONS=0`` to run
the whole suite as users' programs compile.
"""

import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
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
# Every program, however quick to compile: tests compile many alike (in both workers, in other tests' jits),
# and unoptimised compilation is quick for most.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

NUM_DEVICES = 8


@pytest.fixture(autouse=True)
def _need_devices(request):
    need = request.node.get_closest_marker("devices")
    if need is not None and jax.device_count() < need.args[0]:
        pytest.skip(f"needs {need.args[0]} devices, have {jax.device_count()}")


@pytest.fixture(autouse=True)
def _xla_optimized(request):
    """Under ``@pytest.mark.xla_optimized``, the programs the test compiles get XLA's optimisations. JAX's
    in-memory caches do not key on them: such a test must build its own functions, not reuse another
    test's compiled ones."""
    if request.node.get_closest_marker("xla_optimized") is None:
        yield
        return
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
