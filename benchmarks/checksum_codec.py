"""TensorStore's zarr3 ``crc32c`` codec against multimesh's per-leaf checksum: what each catches, what each costs.

    python benchmarks/checksum_codec.py [--mb 256] [--rounds 5] [--dir /tmp]

Orbax (0.12) writes each array as a zarr3 array in an OCDBT key-value store, chunks inside a
``sharding_indexed`` codec whose *index* carries a ``crc32c`` but whose chunk data does not. The zarr3
``crc32c`` codec can also be put on the chunk data (``codecs: [bytes, crc32c]``). This script writes the
same float32 array with TensorStore directly, in both forms, into an OCDBT store as Orbax does, then:

1. **Corruption.** Damages the data file four ways (one bit flipped, one byte flipped, 4 KiB zeroed,
   the last 4 KiB cut off), reads the array back, and says per form whether the read raised, returned
   wrong values silently, or returned the right values; multimesh's checksum
   (``multimesh.checkpoint.checksum``) of what was read is compared with the one of what was written.
2. **Cost.** Times writing the array in each form, and multimesh's checksum of the same array, medians over
   ``--rounds``, the first write of each form untimed.

Prints one table per part; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import tensorstore as ts

from multimesh.checkpoint import checksum

CHUNK = [256, 1024]


def spec(path: Path, shape: tuple[int, ...], chunk_crc32c: bool) -> dict:
    """A zarr3 array in an OCDBT store laid out as Orbax 0.12 writes one (its chunk codecs), with the
    ``crc32c`` codec added on the chunk data when ``chunk_crc32c``."""
    data_codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if chunk_crc32c:
        data_codecs.append({"name": "crc32c"})
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "ocdbt", "base": f"file://{path}", "path": "w"},
        "metadata": {
            "shape": list(shape), "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shape)}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": CHUNK, "codecs": data_codecs,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                "index_location": "end"}}],
        },
        "create": True, "delete_existing": True,
    }


def write(path: Path, x: np.ndarray, chunk_crc32c: bool) -> float:
    t0 = time.perf_counter()
    arr = ts.open(spec(path, x.shape, chunk_crc32c)).result()
    arr.write(x).result()
    return time.perf_counter() - t0


def read(path: Path, shape: tuple[int, ...], chunk_crc32c: bool) -> np.ndarray:
    s = spec(path, shape, chunk_crc32c)
    s.pop("create"), s.pop("delete_existing")
    ts_ctx = ts.Context()  # no cache shared with the write
    return ts.open(s, context=ts_ctx).result().read().result()


def largest_data_file(path: Path) -> Path:
    return max((p for p in path.rglob("*") if p.is_file() and "manifest" not in p.name),
               key=lambda p: p.stat().st_size)


def damage(file: Path, how: str) -> None:
    data = bytearray(file.read_bytes())
    mid = len(data) // 2
    if how == "bit":
        data[mid] ^= 0x10
    elif how == "byte":
        data[mid] ^= 0xFF
    elif how == "zero 4 KiB":
        data[mid:mid + 4096] = bytes(min(4096, len(data) - mid))
    elif how == "cut 4 KiB":
        del data[-4096:]
    file.write_bytes(bytes(data))


def one_checksum(x: np.ndarray) -> str:
    return checksum.checksums([jax.device_put(x, jax.devices()[0])])[0]


def corruption_table(root: Path, x: np.ndarray) -> list[tuple[str, str, str]]:
    expected = one_checksum(x)
    rows = []
    for how in ("bit", "byte", "zero 4 KiB", "cut 4 KiB"):
        for chunk_crc32c in (False, True):
            path = root / f"c-{chunk_crc32c}"
            shutil.rmtree(path, ignore_errors=True)
            write(path, x, chunk_crc32c)
            damage(largest_data_file(path), how)
            form = "chunk crc32c" if chunk_crc32c else "as Orbax writes"
            try:
                y = read(path, x.shape, chunk_crc32c)
            except Exception as e:  # noqa: BLE001 - any refusal counts as caught
                rows.append((how, form, f"raised ({type(e).__name__}: {str(e).splitlines()[0][:60]})"))
                continue
            if np.array_equal(y, x):
                rows.append((how, form, "right values (the damage missed the data)"))
            else:
                caught = one_checksum(y) != expected
                rows.append((how, form, "WRONG VALUES, silently; multimesh's checksum "
                             + ("catches it" if caught else "misses it")))
    return rows


def cost_table(root: Path, x: np.ndarray, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"write, as Orbax writes": [], "write, chunk crc32c": [],
                                     "multimesh checksum of the array": []}
    device_x = jax.device_put(x, jax.devices()[0])
    for chunk_crc32c in (False, True):
        write(root / "warm", x, chunk_crc32c)
    checksum.checksums([device_x])
    for r in range(rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for chunk_crc32c in order:
            key = "write, chunk crc32c" if chunk_crc32c else "write, as Orbax writes"
            path = root / f"w{r}-{chunk_crc32c}"
            times[key].append(write(path, x, chunk_crc32c))
            os.sync()
            shutil.rmtree(path)
        t0 = time.perf_counter()
        checksum.checksums([device_x])
        times["multimesh checksum of the array"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=256.0, help="array size for the cost table (MB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="crc32c-", dir=args.dir))
    try:
        rng = np.random.default_rng(0)
        small = rng.standard_normal((1024, 1024), dtype=np.float32)
        print("corruption of the data file of a float32[1024,1024] array (4 MiB), read back:")
        for how, form, outcome in corruption_table(root, small):
            print(f"  {how:11s} | {form:16s} | {outcome}")
        rows = int(args.mb * 2**20 / 4 / 1024) // CHUNK[0] * CHUNK[0]
        big = rng.standard_normal((rows, 1024), dtype=np.float32)
        med = cost_table(root, big, args.rounds)
        mb = big.nbytes / 2**20
        base = med["write, as Orbax writes"]
        print(f"\ncost for float32[{rows},1024] ({mb:.0f} MiB), median of {args.rounds} rounds:")
        for k, v in med.items():
            print(f"  {k:33s} {v * 1e3:8.1f} ms  {mb / v:7.0f} MiB/s  {v / base:5.2f}x the plain write")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
