"""What naming module copies by the parameters they read costs `parallelize`.

    python benchmarks/twin_names.py [--rounds 9]

On 8 simulated CPU devices, the NNX net of ``tests/test_nnx_tasks.py`` (embed, 4 blocks of one
structure, head) is pipelined over two stages by attribute path (``embed|blocks.[01]`` and
``blocks.[23]|head``), each block rematerialised three ways:

- ``nnx.remat`` (graph mode): NNX records which block each copy stands for; no twins to name;
- ``nnx.remat, tree mode`` and ``jax.checkpoint``: each copy is a new object JAX's unflattening made, a
  twin of all four blocks, named once the step is traced by the parameters its equations read
  (`multimesh.trace.twin_names`).

Printed per way: the median time of ``parallelize(...)`` (trace, name, plan, layouts; nothing compiled)
over ``--rounds`` rounds that alternate the ways after one round left out (imports, JAX's caches), the
median time in it spent looking copies' twins up while tracing and naming them after, and the build time
against the graph-mode one measured in the same rounds.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_nnx_tasks as net  # noqa: E402  (the tests' model, stages and batch)

from multimesh.jax import parallelize  # noqa: E402
from multimesh.trace import nnx_scopes  # noqa: E402

WAYS = list(net.REMATS)


TIMED = ("_twin_path", "name_twins")  # looking a copy's twins up while tracing; naming them after


def build(way: str, spent: dict[str, float]) -> float:
    """Seconds to ``parallelize`` the step with blocks under ``way``; the time in each of `TIMED` added to
    ``spent``."""
    step, init = net._remat_parts(None, way)
    first, second = net._stages()
    originals = {name: getattr(nnx_scopes._Tracing, name) for name in TIMED}

    def timed(name):
        def call(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return originals[name](self, *args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return call

    for name in TIMED:
        setattr(nnx_scopes._Tracing, name, timed(name))
    try:
        with first, second:
            start = time.perf_counter()
            step_fn, _, _ = parallelize(step, init_params=init, get_input_batch=net.get_batch)
            elapsed = time.perf_counter() - start
    finally:
        for name, original in originals.items():
            setattr(nnx_scopes._Tracing, name, original)
    assert [p.name for p in step_fn.plan.placements] == ["first", "second"], way
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    for way in WAYS:  # a first round of each, left out
        build(way, {})
    builds: dict[str, list[float]] = {w: [] for w in WAYS}
    parts: dict[str, dict[str, list[float]]] = {w: {name: [] for name in TIMED} for w in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            spent: dict[str, float] = {}
            builds[way].append(build(way, spent))
            for name in TIMED:
                parts[way][name].append(spent.get(name, 0.0))
    base = statistics.median(builds[WAYS[0]])
    print(f"parallelize of a 2-stage NNX pipeline, 4 rematerialised blocks; medians of {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'blocks under':<24} {'build ms':>9} {'twin lookup ms':>15} {'naming ms':>10} {'x graph-mode':>13}")
    for way in WAYS:
        median = statistics.median(builds[way])
        lookup, naming = (statistics.median(parts[way][name]) * 1e3 for name in TIMED)
        print(f"{way:<24} {median * 1e3:9.1f} {lookup:15.2f} {naming:10.2f} {median / base:13.2f}")


if __name__ == "__main__":
    main()
