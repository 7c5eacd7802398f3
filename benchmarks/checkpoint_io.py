"""Checkpoint throughput: `multimesh.checkpoint` against raw Orbax and the disk itself.

Two states, each saved and restored, interleaved, best of ``--rounds``:

* large: ``--size-gb`` GB in ``--leaves`` float32 (rows, 4096) arrays,
  ``P('data', 'model')`` on a 4x2 mesh of 8 simulated CPU devices;
* many leaves: ``--many-leaves`` small arrays totalling ``--many-size-gb`` GB,
  shaped like an optimizer state (3 of 4 leaves are (rows, 512) matrices on
  ``P('data', 'model')``, 1 of 4 a (512,) vector on ``P('model')``), so that
  per-leaf and per-shard overheads show.

By:

* ours: ``multimesh.checkpoint.CheckpointManager`` (async save + wait; with
  and without the per-leaf checksums it records and verifies by default; with
  ``--zstd`` also with zstd-compressed chunks, Orbax's default);
* raw Orbax: ``orbax.checkpoint.CheckpointManager`` with ``StandardSave`` /
  ``StandardRestore``, the same tree and the same restore targets, with its
  default zstd-compressed chunks and without ("raw orbax, no zstd", the same
  bytes on disk as ours);
* the disk: ``dd`` writing the same number of bytes (``conv=fdatasync``) and
  reading them back.

Each library first saves each state once, untimed (a process's first save
is slow: it pays for page cache and Orbax's caches). Rounds rotate the order
of the libraries and of the restore targets, and ``sync`` settles the disk
before each operation; the tables show the best round, a last block the
medians. Every restore (and the dd read) starts cold: the files' pages are
dropped from the page cache first (``posix_fadvise(DONTNEED)``, per file, no
root needed). The large state is
also restored onto an 8x1 mesh and onto 4 devices (another layout), the many
leaves onto 8x1.

``--baseline DIR`` also times another copy of the ``multimesh.checkpoint``
package, interleaved with the rest ("before: ..." columns), e.g. the one of an
older commit::

    git archive 3c14436 multimesh/checkpoint | tar -x -C /tmp/before
    python benchmarks/checkpoint_io.py --baseline /tmp/before/multimesh/checkpoint

    python benchmarks/checkpoint_io.py [--size-gb 1.0] [--rounds 3] [--many-leaves 2000] [--zstd] [--dir /tmp]

A large state on its own, within ~20 minutes on a 2-core host whose disk
writes ~0.2 GB/s (needs ~3x the state in memory: the state, a restored copy,
page cache)::

    python benchmarks/checkpoint_io.py --size-gb 4 --rounds 2 --many-leaves 0
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.checkpoint import CheckpointManager

GB = 1e9
SPEC = P("data", "model")
COLS = 4096
MANY_COLS = 512


# ------------------------------------------------------------------ the state
def mesh(shape: tuple[int, int], n_devices: int = 8) -> Mesh:
    return Mesh(np.array(jax.devices()[:n_devices]).reshape(shape), ("data", "model"))


def _random(shape: tuple[int, ...], sharding: NamedSharding, key: jax.Array) -> jax.Array:
    make = jax.jit(lambda k: jax.random.normal(k, shape, np.float32), out_shardings=sharding)
    return make(key)


def make_large(size_gb: float, leaves: int, m: Mesh) -> dict[str, jax.Array]:
    """``leaves`` random float32 (rows, 4096) arrays totalling ~``size_gb`` GB,
    created directly in their shardings (random data: nothing compresses)."""
    rows = max(8, int(size_gb * GB / leaves / 4 / COLS) // 8 * 8)
    keys = jax.random.split(jax.random.key(0), leaves)
    state = {f"w{i:02d}": _random((rows, COLS), NamedSharding(m, SPEC), keys[i]) for i in range(leaves)}
    jax.block_until_ready(state)
    return state


def make_many(size_gb: float, leaves: int, m: Mesh) -> dict[str, jax.Array]:
    """``leaves`` small random float32 arrays, ~``size_gb`` GB in all: 3 of 4
    (rows, 512) matrices on P('data', 'model'), 1 of 4 (512,) vectors on P('model')."""
    mats = leaves - leaves // 4
    rows = max(8, int(size_gb * GB / max(1, mats) / 4 / MANY_COLS) // 8 * 8)
    keys = jax.random.split(jax.random.key(1), leaves)
    state = {}
    for i in range(leaves):
        if i % 4 == 3:
            state[f"l{i:04d}"] = _random((MANY_COLS,), NamedSharding(m, P("model")), keys[i])
        else:
            state[f"l{i:04d}"] = _random((rows, MANY_COLS), NamedSharding(m, SPEC), keys[i])
    jax.block_until_ready(state)
    return state


def target_on(state: dict, m: Mesh) -> dict:
    def spec(v):
        return SPEC if v.ndim == 2 else P("model")
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(m, spec(v))) for k, v in state.items()}


def nbytes(state: dict) -> int:
    return sum(v.nbytes for v in state.values())


# ------------------------------------------------------------------ the disk
def evict(path: str) -> None:
    """Drops ``path``'s files (a file or a tree) from the page cache, so the next
    read comes from the disk; flushes them first (DONTNEED skips dirty pages)."""
    files = [path] if os.path.isfile(path) else [
        os.path.join(root, f) for root, _, names in os.walk(path) for f in names]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd(path: str, n: int) -> dict[str, float]:
    """Seconds for dd to write ``n`` bytes (fdatasync), read them cold, and read them cached."""
    block = 16 << 20
    count = max(1, round(n / block))

    def run(*args: str) -> float:
        t = time.perf_counter()
        subprocess.run(["dd", *args, f"bs={block}", "status=none"], check=True)
        return time.perf_counter() - t

    out = {"write": run("if=/dev/zero", f"of={path}", f"count={count}", "conv=fdatasync")}
    evict(path)
    os.sync()
    out["read"] = run(f"if={path}", "of=/dev/null")
    out["read, page cache"] = run(f"if={path}", "of=/dev/null")
    os.remove(path)
    scale = n / (count * block)  # dd moved whole blocks
    return {k: v * scale for k, v in out.items()}


# ------------------------------------------------------------- the libraries
class Ours:
    def __init__(self, checksums: bool, manager: type = CheckpointManager, **options):
        self.checksums = checksums
        self.manager = manager
        self.options = options

    def save(self, directory: str, state: dict) -> None:
        with self.manager(directory, max_to_keep=None, checksums=self.checksums, **self.options) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()

    def restore(self, directory: str, target: dict) -> dict:
        with self.manager(directory, read_only=True, checksums=self.checksums) as mgr:
            return mgr.restore(1, target=target).state


def load_baseline(directory: str) -> type:
    """``CheckpointManager`` of the ``multimesh.checkpoint`` package copy in ``directory``."""
    name = "multimesh.checkpoint_baseline"  # inside multimesh: its `..core` imports resolve
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(directory, "__init__.py"), submodule_search_locations=[directory])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.CheckpointManager


class _UncompressedStandard(ocp.StandardCheckpointHandler):
    """Orbax's own ``StandardCheckpointHandler`` (its read and write paths)
    with zstd off, as ours writes by default."""

    def __init__(self):
        super().__init__()
        self._impl = ocp.PyTreeCheckpointHandler(use_compression=False)


class RawOrbax:
    """Orbax's ``CheckpointManager`` with ``StandardSave`` / ``StandardRestore``:
    its defaults (zstd on) or, with ``compression=False``, uncompressed chunks."""

    def __init__(self, compression: bool = True):
        self.compression = compression

    def _manager(self, directory: str, options: ocp.CheckpointManagerOptions) -> ocp.CheckpointManager:
        handler = ocp.StandardCheckpointHandler() if self.compression else _UncompressedStandard()
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("state", ocp.args.StandardSave, handler)
        registry.add("state", ocp.args.StandardRestore, handler)
        return ocp.CheckpointManager(directory, options=options, handler_registry=registry)

    def save(self, directory: str, state: dict) -> None:
        options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=True)
        with self._manager(directory, options) as mgr:
            mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
            mgr.wait_until_finished()

    def restore(self, directory: str, target: dict) -> dict:
        options = ocp.CheckpointManagerOptions(read_only=True)
        with self._manager(directory, options) as mgr:
            return mgr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - t, out


def check_restored(restored: dict, state: dict, target: dict) -> None:
    """Two leaves' values and every leaf's sharding (outside the timed part)."""
    for k in list(state)[:1] + list(state)[-1:]:
        assert np.array_equal(np.asarray(restored[k]), np.asarray(state[k])), f"restored {k} differs"
    for name, t in target.items():
        assert restored[name].sharding == t.sharding, f"{name}: {restored[name].sharding}"


def rotated(items: list, r: int) -> list:
    """``items`` starting at position ``r``: no operation always goes first."""
    r %= len(items)
    return items[r:] + items[:r]


def one_round(lib, root: str, state: dict, targets: dict[str, dict], r: int) -> dict[str, float]:
    """Save, then restore cold onto every target (in a rotated order); seconds
    per operation. The first round also checks what comes back."""
    directory = tempfile.mkdtemp(dir=root)
    check = r == 0
    try:
        os.sync()  # no writeback left over from the previous operation
        times = {"save": timed(lambda: lib.save(directory, state))[0]}
        for name, target in rotated(list(targets.items()), r):
            evict(directory)
            os.sync()
            seconds, restored = timed(lambda t=target: lib.restore(directory, t))
            if check:
                check_restored(restored, state, target)
            del restored
            times[f"restore {name}"] = seconds
        return times
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ------------------------------------------------------------------ reporting
def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def report(best: dict[str, dict[str, float]], disk: dict[str, float], n: int) -> str:
    """The GB/s table (every library, dd) with ratios of times (> 1: ours is
    faster), and the restore times per target layout."""
    gbs = lambda s: f"{n / GB / s:.2f}"
    ours, raw = best["ours"], best["raw orbax"]
    raws = [k for k in ("raw orbax", "raw orbax, no zstd") if k in best]
    names = ["ours", "ours, no checksums", *[k for k in best if k not in ("ours", "ours, no checksums", *raws)],
             *raws]
    ratios = [("ours / raw", "raw orbax"), *([("ours / raw no zstd", "raw orbax, no zstd")] if len(raws) > 1 else []),
              ("ours / no checksums", "ours, no checksums")]
    if "before" in best:
        ratios.append(("ours / before", "before"))
    rows = []
    for op in ours:
        dd_s = disk["write"] if op == "save" else disk["read"]
        rows.append([op, *(gbs(best[k][op]) for k in names), gbs(dd_s),
                     *(f"{best[k][op] / ours[op]:.2f}" for _, k in ratios), f"{dd_s / ours[op]:.2f}"])
    rows.append(["dd read, page cache", *("" for _ in names), gbs(disk["read, page cache"]),
                 *("" for _ in ratios), ""])
    speed = table(["GB/s", *names, "dd", *(r for r, _ in ratios), "ours / dd"], rows)
    same = next(op for op in ours if op.startswith("restore") and "(same)" in op)
    layout_rows = [[op.removeprefix("restore "), f"{ours[op]:.2f} s", f"{ours[op] / ours[same]:.2f}",
                    f"{raw[op]:.2f} s", f"{raw[op] / raw[same]:.2f}"]
                   for op in ours if op.startswith("restore")]
    layouts = table(["restore onto", "ours", "ours vs same layout", "raw orbax", "raw vs same layout"], layout_rows)
    return f"{speed}\n\n{layouts}"


def measure(title: str, state: dict, targets: dict[str, dict], libs: dict, rounds: int, root: str) -> None:
    n = nbytes(state)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in libs}
    disks: list[dict[str, float]] = []
    for lib in libs.values():  # untimed: a process's first save of a state is slow (page cache, caches)
        directory = tempfile.mkdtemp(dir=root)
        lib.save(directory, state)
        shutil.rmtree(directory, ignore_errors=True)
    for r in range(rounds):
        for name, lib in rotated(list(libs.items()), r):
            runs[name].append(one_round(lib, root, state, targets, r))
        os.sync()
        disks.append(dd(os.path.join(root, "dd.bin"), n))
        print(f"{title}, round {r + 1}/{rounds}: " + ", ".join(
            f"{name} save {t['save']:.2f} s" for name, t in ((k, v[-1]) for k, v in runs.items()))
            + f", dd write {disks[-1]['write']:.2f} s", flush=True)
    best = {name: {op: min(t[op] for t in ts) for op in ts[0]} for name, ts in runs.items()}
    disk = {op: min(d[op] for d in disks) for op in disks[0]}
    spread = max(statistics.median(t["save"] for t in ts) / best[name]["save"] for name, ts in runs.items())
    shapes = sorted({(tuple(v.shape), str(v.sharding.spec)) for v in state.values()})
    print(f"\n{title}: {n / GB:.2f} GB in {len(state)} float32 arrays "
          f"({', '.join(f'{s} {spec}' for s, spec in shapes)}) on a 4x2 mesh of 8 CPU devices; best of "
          f"{rounds} rounds (median/best save time up to {spread:.2f}); restores start with the files "
          f"evicted from the page cache. Ratios > 1: ours is faster.\n")
    print(report(best, disk, n), "\n")
    median = {name: {op: statistics.median(t[op] for t in ts) for op in ts[0]} for name, ts in runs.items()}
    print("Medians of the rounds, ours against each (ratios of times, > 1: ours is faster):")
    for op in median["ours"]:
        print(f"  {op:26s} " + "  ".join(f"{name} {median[name][op] / median['ours'][op]:.2f}"
                                         for name in median if name != "ours"))
    print(flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0, help="large state: size in GB (1e9 bytes)")
    ap.add_argument("--leaves", type=int, default=8, help="large state: number of arrays")
    ap.add_argument("--many-leaves", type=int, default=2000, help="many-leaves state: number of arrays (0: skip)")
    ap.add_argument("--many-size-gb", type=float, default=0.25, help="many-leaves state: size in GB")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best is reported")
    ap.add_argument("--zstd", action="store_true", help="also time ours with zstd-compressed chunks")
    ap.add_argument("--baseline", metavar="DIR", help="also time the multimesh.checkpoint package copy in DIR")
    ap.add_argument("--dir", default="/tmp", help="where the temporary checkpoint folder goes")
    args = ap.parse_args()
    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, have {jax.device_count()} (XLA_FLAGS={os.environ.get('XLA_FLAGS')})")
    absl_logging.set_verbosity(absl_logging.ERROR)

    libs = {"ours": Ours(checksums=True), "ours, no checksums": Ours(checksums=False), "raw orbax": RawOrbax(),
            "raw orbax, no zstd": RawOrbax(compression=False)}
    if args.zstd and "compression" in inspect.signature(CheckpointManager).parameters:
        libs["ours, zstd"] = Ours(checksums=True, compression=True)
    if args.baseline:
        before = load_baseline(args.baseline)
        libs["before"] = Ours(checksums=True, manager=before)
    root = tempfile.mkdtemp(prefix="multimesh-ckpt-bench-", dir=args.dir)
    try:
        if args.size_gb > 0:
            state = make_large(args.size_gb, args.leaves, mesh((4, 2)))
            targets = {"4x2 (same)": target_on(state, mesh((4, 2))), "8x1": target_on(state, mesh((8, 1))),
                       "2x2 on 4 devices": target_on(state, mesh((2, 2), 4))}
            measure("large state", state, targets, libs, args.rounds, root)
            del state, targets
        if args.many_leaves > 0:
            state = make_many(args.many_size_gb, args.many_leaves, mesh((4, 2)))
            targets = {"4x2 (same)": target_on(state, mesh((4, 2))), "8x1": target_on(state, mesh((8, 1)))}
            measure("many-leaves state", state, targets, libs, args.rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
