"""Partial restores: a subtree (``path=``) or a subset (``partial=True``) of a saved state.

The state is a train state of parameters and Adam moments saved on
``data=4 x model=2``; the parameters alone are restored onto other layouts and
compared bit for bit with a full restore. Host values, so nothing is compiled.
"""

from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from multimesh.checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointMismatchError,
    abstract_target,
)
from multimesh.checkpoint import handlers as ckpt_handlers

pytestmark = pytest.mark.devices(8)


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState


def _params() -> dict:
    rng = np.random.default_rng(0)
    return {"dense": {"kernel": rng.standard_normal((8, 16), dtype=np.float32),
                      "bias": rng.standard_normal((16,), dtype=np.float32)},
            "embed": rng.standard_normal((16, 8)).astype(jnp.bfloat16)}


def _placed(tree, mesh):
    """Every leaf over ``mesh``: a matrix split over both axes, a vector over ``model``."""
    def put(x):
        spec = P("data", "model") if np.ndim(x) == 2 else P("model") if np.ndim(x) == 1 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))
    return jax.tree.map(put, tree)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A TrainState (step, params, Adam state with non-zero moments) saved as step 5."""
    params = _params()
    opt = jax.tree.map(lambda x: np.full(x.shape, 0.5, x.dtype), optax.adam(1e-3).init(params))
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    state = _placed(TrainState(np.asarray(5, np.int32), params, opt), mesh)
    directory = tmp_path_factory.mktemp("partial") / "ckpt"
    with CheckpointManager(directory) as mgr:
        mgr.save(5, state)
    return directory, params


def _fsdp_target(params) -> dict:
    """The parameters on another layout: 8-way over rows on one mesh, the
    bfloat16 table on the last 4 devices only (another submesh), replicated."""
    fsdp = NamedSharding(jax.make_mesh((8,), ("fsdp",)), P("fsdp"))
    last4 = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[4:]), ("stage",)), P())
    shardings = {"dense": {"kernel": fsdp, "bias": fsdp}, "embed": last4}
    return abstract_target(jax.eval_shape(lambda: params), shardings)


class _ReadLog:
    """Records the names of the arrays the checkpoint handler reads."""

    def __init__(self, monkeypatch):
        self.names: list[str] = []
        original = ckpt_handlers.ArrayHandler.deserialize

        async def deserialize(handler, infos, args=None):
            self.names += [info.name for info in infos]
            return await original(handler, infos, args)

        monkeypatch.setattr(ckpt_handlers.ArrayHandler, "deserialize", deserialize)


def _full_target(params):
    one = SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda: TrainState(jnp.int32(0), params, optax.adam(1e-3).init(params)))
    return abstract.replace(params=_fsdp_target(params)).replace(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=one),
        opt_state=abstract_target(abstract.opt_state, one))


def test_path_restores_only_the_params_bit_for_bit_onto_another_layout(saved, monkeypatch):
    directory, params = saved
    target = _fsdp_target(params)
    with CheckpointManager(directory, read_only=True) as mgr:
        full = mgr.restore(target=_full_target(params)).state
        reads = _ReadLog(monkeypatch)
        got = mgr.restore(5, target=target, path="params")
    assert got.step == 5
    assert sorted(reads.names) == ["params.dense.bias", "params.dense.kernel", "params.embed"]
    assert jax.tree.structure(got.state) == jax.tree.structure(target)
    for x, t, ref, host in zip(jax.tree.leaves(got.state), jax.tree.leaves(target),
                               jax.tree.leaves(full.params), jax.tree.leaves(params)):
        assert x.sharding == t.sharding and x.dtype == t.dtype
        assert np.array_equal(np.asarray(x), np.asarray(ref)) and np.array_equal(np.asarray(x), host)
    assert got.state["dense"]["kernel"].addressable_shards[0].data.shape == (1, 16)


def test_partial_target_holding_params_reads_nothing_else(saved, monkeypatch):
    directory, params = saved
    target = {"params": _fsdp_target(params)}
    with CheckpointManager(directory, read_only=True) as mgr:
        reads = _ReadLog(monkeypatch)
        got = mgr.restore(target=target, partial=True).state
    assert sorted(reads.names) == ["params.dense.bias", "params.dense.kernel", "params.embed"]
    assert set(got) == {"params"}
    for x, host in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(params)):
        assert np.array_equal(np.asarray(x), host)


def test_partial_within_a_path_and_a_single_leaf(saved):
    """``path`` and ``partial`` together (one leaf of the moments), and a path naming one leaf."""
    directory, params = saved
    one = SingleDeviceSharding(jax.devices()[5])
    kernel = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=one)
    with CheckpointManager(directory, read_only=True) as mgr:
        mu = mgr.restore(target={"dense": {"kernel": kernel}}, path="opt_state/0/mu", partial=True).state
        step = mgr.restore(target=jax.ShapeDtypeStruct((), jnp.int32, sharding=one), path="step").state
    assert np.array_equal(np.asarray(mu["dense"]["kernel"]), np.full((8, 16), 0.5, np.float32))
    assert int(step) == 5 and step.sharding == one


def test_subtree_errors_name_the_path_and_the_nearest_saved_ones(saved):
    directory, params = saved
    target = _fsdp_target(params)
    with CheckpointManager(directory, read_only=True) as mgr:
        with pytest.raises(CheckpointMismatchError, match=r"parms \(no saved leaf at or under this path; "
                                                          r"nearest saved: params\b"):
            mgr.restore(target=target, path="parms")
        with pytest.raises(CheckpointMismatchError) as err:
            mgr.restore(target={"params": {**target, "dense": {"kernal": target["dense"]["kernel"]}}}, partial=True)
        assert ("unexpected in target (not in checkpoint): params/dense/kernal [8, 16] float32 "
                "(nearest saved: params/dense/kernel") in str(err.value)
        assert err.value.unexpected and not err.value.missing  # partial: left-out leaves are fine
        wrong = {**target, "embed": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=target["embed"].sharding)}
        with pytest.raises(CheckpointMismatchError) as err:
            mgr.restore(target=wrong, path="params")
        assert "shape mismatch at params/embed: saved (16, 8), target (16, 4)" in str(err.value)
        assert "dtype mismatch at params/embed: saved bfloat16, target float32" in str(err.value)
        del wrong["embed"]
        with pytest.raises(CheckpointMismatchError, match=r"missing from target \(saved in checkpoint\): "
                                                          r"params/embed \[16, 8\] bfloat16"):
            mgr.restore(target=wrong, path="params")  # a path's subtree is whole unless partial
        with pytest.raises(TypeError, match=r"path must be a str .* got tuple"):
            mgr.restore(target=target, path=("params",))
        with pytest.raises(ValueError, match=r"target for path 'params' has no leaves"):
            mgr.restore(target={}, path="params")


def test_full_restore_of_a_subtree_says_how_to_restore_part(saved):
    directory, params = saved
    with CheckpointManager(directory, read_only=True) as mgr, pytest.raises(CheckpointMismatchError) as err:
        mgr.restore(target={"params": _fsdp_target(params)})
    msg = str(err.value)
    assert "missing from target (saved in checkpoint): opt_state/0/mu/dense/kernel" in msg
    assert "pass partial=True" in msg and "path='params'" in msg


def test_partial_restore_verifies_checksums_of_what_it_reads(tmp_path):
    """A flipped byte in one leaf's data: restoring that leaf is an error naming
    it; restoring another leaf alone succeeds (the damaged one is not read)."""
    rng = np.random.default_rng(5)
    values = {"w": rng.standard_normal((256, 256), dtype=np.float32),
              "b": rng.standard_normal((32,), dtype=np.float32)}
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, _placed(values, mesh))
    data = max(glob.glob(str(tmp_path / "c" / "1" / "state" / "**" / "d" / "*"), recursive=True),
               key=os.path.getsize)
    with open(data, "r+b") as f:  # one byte in the middle of the largest file: w's data
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    one = SingleDeviceSharding(jax.devices()[1])
    with CheckpointManager(tmp_path / "c", read_only=True) as mgr:
        with pytest.raises(CheckpointCorruptError, match=r"checksum mismatch\) at w") as err:
            mgr.restore(target={"w": jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=one)}, partial=True)
        assert err.value.leaves == ("w",)
        b = mgr.restore(target=jax.ShapeDtypeStruct((32,), jnp.float32, sharding=one), path="b").state
    assert np.array_equal(np.asarray(b), values["b"])


def test_nnx_model_of_a_saved_model_and_optimizer(tmp_path):
    """NNX objects as targets: the model alone out of a saved ``(model, optimizer)``, by path or partially."""
    from flax import nnx

    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, (model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)))
        by_path = mgr.restore(target=nnx.Linear(4, 3, rngs=nnx.Rngs(7)), path="0").state
        (partial,) = mgr.restore(target=(nnx.Linear(4, 3, rngs=nnx.Rngs(7)),), partial=True).state
    for restored in (by_path, partial):
        assert isinstance(restored, nnx.Linear)
        assert np.array_equal(np.asarray(restored.kernel[...]), np.asarray(model.kernel[...]))
        assert np.array_equal(np.asarray(restored.bias[...]), np.asarray(model.bias[...]))


def test_a_mismatch_of_many_leaves_is_summarised_with_the_hint_first():
    """Another optimizer's state against the saved one (a hundred leaves differ): the counts and the hint
    come first, naming the subtree they all lie under; a dozen lines of differences, then how many more."""
    from multimesh.checkpoint import CheckpointMismatchError

    missing = [f"opt/0/mu/layers_{i}/kernel [8, 8] float32" for i in range(60)]
    unexpected = [f"opt/0/trace/layers_{i}/kernel [8, 8] float32 (nearest saved: opt/0/mu/layers_{i}/kernel)"
                  for i in range(50)]
    lines = str(CheckpointMismatchError(7, "/ck", missing, unexpected, [])).splitlines()
    assert lines[0] == ("restore target does not match checkpoint step 7 in /ck: 60 saved leaf(s) missing from the "
                        "target, 50 target leaf(s) not in the checkpoint."), lines[0]
    assert lines[1].startswith("All of them lie under 'opt': the state that saved it had another 'opt'"), lines[1]
    assert "path='params'" in lines[1] and "partial=True" in lines[1]
    assert len(lines) <= 16 and lines[-1] == "  ... and 98 more (all in the error's missing, unexpected and mismatched)"
    assert lines[2] == f"  missing from target (saved in checkpoint): {missing[0]}"
