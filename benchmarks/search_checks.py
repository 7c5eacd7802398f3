"""How long `auto_layout` takes on public models, with and without the checks that set layouts aside unbuilt.

    python benchmarks/search_checks.py [--models flax_gemma nanodo flax_resnet] [--rounds 3]

On 8 simulated CPU devices, each vendored model of ``tests/`` is searched as a
user would call it (`auto_layout(step, init_params=..., get_input_batch=...,
profile="h100-sxm")`, all rule sets, SPMD layouts), in rounds that alternate
the two ways:

- ``checks``: as built: once one layout is built, a layout with an axis none
  of the step's arrays can be sharded over (`checks.idle_by_names`) and a
  data x fsdp layout whose fsdp shards no parameter (`checks.fsdp_as_data`)
  are set aside without being built;
- ``every layout built``: the same search with those two checks off, so each
  such layout is traced and planned before `idle_axis` rejects it (the
  search before these checks; the data x fsdp duplicates are then compiled
  and estimated too).

Printed per model: the layouts, how many were built (``parallelize`` calls),
the median search time of each way over ``--rounds`` rounds, and their ratio.
Each search starts with an empty cache of compiled programs
(`estimate.programs.compiled_once` keeps them across searches), as a search
in a fresh process does; a first round of each model, which also pays for
imports and tracing caches, is left out of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import jax  # noqa: E402

import multimesh.autolayout.search as search_module  # noqa: E402
import multimesh.estimate.programs as programs_module  # noqa: E402
from multimesh.autolayout import auto_layout  # noqa: E402


def _models() -> dict:
    """name -> (step, keyword arguments, context) as the tests set each model up."""
    import test_thirdparty_models as T
    import test_thirdparty_resnet as R

    out = {}
    for name in ("flax_gemma", "nanodo", "flax_on_pjit", "flax_lm1b", "flax_wmt"):
        m = T.model(name)
        kwargs = {"init_params": m.init, "get_input_batch": m.batch,
                  **({"param_rules": m.param_rules} if m.param_rules else {})}
        out[name] = (T.make_step(m.loss), kwargs, m.context)
    out["flax_resnet"] = (R.train_step, {"init_params": R.init, "get_input_batch": R.get_batch}, None)
    return out


def _search(step, kwargs, context, checks: bool) -> tuple[float, int, int]:
    """(seconds, layouts, layouts built) of one search."""
    built = []
    real_build, real_idle, real_fsdp = search_module.build_on, search_module.idle_by_names, search_module.fsdp_as_data
    search_module.build_on = lambda layout, *a, **k: built.append(layout) or real_build(layout, *a, **k)
    if not checks:
        search_module.idle_by_names = lambda *a: None
        search_module.fsdp_as_data = lambda *a: None
    try:
        programs_module._COMPILED.clear()
        start = time.perf_counter()
        if context is None:
            found = auto_layout(step, profile="h100-sxm", progress=False, **kwargs)
        else:
            with context():
                found = auto_layout(step, profile="h100-sxm", progress=False, **kwargs)
        return time.perf_counter() - start, len(found.candidates), len(built)
    finally:
        search_module.build_on, search_module.idle_by_names = real_build, real_idle
        search_module.fsdp_as_data = real_fsdp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["flax_gemma", "nanodo", "flax_resnet"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    models = _models()
    print(f"{len(jax.devices())} {jax.devices()[0].platform} devices, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; median of {args.rounds} rounds after a first one, each search from an "
          f"empty compile cache")
    print(f"{'model':14s} {'layouts':>7s} {'built (checks / all)':>21s} {'checks s':>9s} {'all built s':>11s} "
          f"{'ratio':>6s}")
    for name in args.models:
        step, kwargs, context = models[name]
        times: dict[bool, list[float]] = {True: [], False: []}
        built: dict[bool, int] = {}
        for r in range(args.rounds + 1):
            for checks in ((True, False) if r % 2 else (False, True)):
                seconds, layouts, built[checks] = _search(step, kwargs, context, checks)
                if r:
                    times[checks].append(seconds)
        fast, slow = statistics.median(times[True]), statistics.median(times[False])
        print(f"{name:14s} {layouts:7d} {f'{built[True]} / {built[False]}':>21s} {fast:9.2f} {slow:11.2f} "
              f"{slow / fast:6.2f}")


if __name__ == "__main__":
    main()
