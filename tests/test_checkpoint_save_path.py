"""The save path's two trims of Orbax's per-shard work (``handlers.py``):
no replica-parallel slicing in one process, and a byte limiter that formats
no log lines. Checked against raw Orbax doing both on the same state, so the
counts can fail; the values still round-trip bit for bit."""

from __future__ import annotations

import asyncio
import sys

import humanize
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.checkpoint import CheckpointManager
from multimesh._compat.orbax import LeanByteLimit

pytestmark = pytest.mark.devices(8)


def _state() -> dict:
    m = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    return {  # "v" is replicated over 'data' (4 replicas of each shard)
        "w": jax.device_put(rng.standard_normal((16, 8), np.float32), NamedSharding(m, P("data", "model"))),
        "v": jax.device_put(rng.standard_normal((64,), np.float32), NamedSharding(m, P("model"))),
    }


def _count_calls(monkeypatch, module, name: str, caller: str = "") -> list:
    """Counts calls of ``module.name`` (made from a file ending in ``caller``)."""
    calls: list = []
    real = getattr(module, name)

    def counting(*a, **k):
        if sys._getframe(1).f_code.co_filename.endswith(caller):
            calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_save_slices_no_replicas_and_formats_no_sizes(tmp_path, monkeypatch):
    state = _state()
    slices = _count_calls(monkeypatch, jax.lax, "slice_in_dim")
    sizes = _count_calls(monkeypatch, humanize, "naturalsize", caller="serialization/limits.py")

    with ocp.CheckpointManager(tmp_path / "raw") as raw:  # control: Orbax's defaults do both
        raw.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        raw.wait_until_finished()
    assert slices and sizes, "raw Orbax no longer slices replicas or formats sizes: the check is moot"

    slices.clear()
    sizes.clear()
    with CheckpointManager(tmp_path / "ours") as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        assert (len(slices), len(sizes)) == (0, 0)
        target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for k, x in state.items()}
        back = mgr.restore(1, target=target).state
    for k, x in state.items():
        assert np.array_equal(np.asarray(back[k]), np.asarray(x)), k


def test_lean_limit_holds_reservations_to_the_limit():
    async def run() -> list[str]:
        limit = LeanByteLimit(100)
        order: list[str] = []
        await limit.wait_for_bytes(60)
        order.append("a in")

        async def second():
            await limit.wait_for_bytes(60)  # must wait: 60 + 60 > 100
            order.append("b in")

        task = asyncio.create_task(second())
        await asyncio.sleep(0.01)
        order.append("a out")
        await limit.release_bytes(60)
        await task
        with pytest.raises(ValueError, match="more bytes"):
            await limit.wait_for_bytes(100)
        return order

    assert asyncio.run(run()) == ["a in", "a out", "b in"]
