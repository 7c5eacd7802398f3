"""multimesh.checkpoint: save on one layout, restore on another, bit for bit.

Runs on the 8 simulated CPU devices of conftest.py. States are built from host
(numpy) values with device_put, so nothing is compiled and the expected values
are exact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from multimesh.checkpoint import (
    CheckpointExistsError,
    CheckpointManager,
    CheckpointMismatchError,
    Restored,
    abstract_target,
    to_json_safe,
)
from multimesh.checkpoint import checksum as ckpt_checksum
from multimesh.checkpoint import handlers as ckpt_handlers
from multimesh.checkpoint import inspect as ckpt_inspect
from multimesh.checkpoint.checksum import checksums
from multimesh.checkpoint.tree import leaves_with_paths

pytestmark = pytest.mark.devices(8)


# ------------------------------------------------------------------ helpers
def mesh(shape, devices=None, names=("data", "model")) -> Mesh:
    devices = jax.devices() if devices is None else devices
    n = int(np.prod(shape))
    return Mesh(np.array(devices[:n]).reshape(shape), names)


def host_state(seed: int = 0) -> dict:
    """A training state with host values: params (f32 + bf16), adamw state with
    non-zero moments, a step counter, a typed PRNG key, a raw uint32 key and a
    batch of typed keys (sharded later)."""
    rng = np.random.default_rng(seed)
    params = {
        "embed": rng.standard_normal((16, 8), dtype=np.float32),
        "dense": {"kernel": rng.standard_normal((8, 16), dtype=np.float32),
                  "bias": rng.standard_normal((16,), dtype=np.float32)},
        "out": rng.standard_normal((16, 8)).astype(jax.numpy.bfloat16),
    }
    opt = optax.adamw(1e-3).init(params)
    opt = jax.tree.map(
        lambda x: np.asarray(rng.standard_normal(x.shape), dtype=x.dtype) if x.ndim
        else np.asarray(3, dtype=x.dtype), opt)
    return {
        "params": params,
        "opt": opt,
        "step": np.asarray(123, np.int32),
        "rng": jax.random.key(seed),
        "raw_rng": np.asarray(jax.random.PRNGKey(seed + 1)),
        "batch_keys": jax.random.split(jax.random.key(seed + 2), 8),
    }


def place(tree, layout):
    """device_put every leaf onto ``layout(path, leaf) -> Sharding``."""
    return jax.tree_util.tree_map_with_path(lambda kp, x: jax.device_put(x, layout(kp, x)), tree)


_DATA_MODEL, _MODEL = P("data", "model"), P("model")


def named(m: Mesh, two_d: P = _DATA_MODEL, one_d: P = _MODEL):
    """Layout: 2-D leaves -> ``two_d``, 1-D -> ``one_d``, scalars replicated, on mesh ``m``."""
    def layout(kp, x):
        spec = {2: two_d, 1: one_d}.get(np.ndim(x), P())
        if np.ndim(x) == 1 and np.shape(x)[0] % 8:  # e.g. a raw (2,) uint32 key
            spec = P()
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            spec = P("data") if x.ndim == 1 else P()
        return NamedSharding(m, spec)
    return layout


def target_like(tree, layout):
    """A restore target: ShapeDtypeStructs with ``layout``'s shardings."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=layout(kp, x)), tree)


def bits(x) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def assert_bitwise(restored, expected, target=None):
    """Same tree, dtypes and bits (and the target's shardings when given)."""
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    flat_r = jax.tree_util.tree_flatten_with_path(restored)[0]
    flat_e = jax.tree.leaves(expected)
    flat_t = jax.tree.leaves(target) if target is not None else [None] * len(flat_e)
    for (kp, r), e, t in zip(flat_r, flat_e, flat_t):
        where = jax.tree_util.keystr(kp)
        assert isinstance(r, jax.Array), where
        assert r.dtype == e.dtype, where
        a, b = bits(r), bits(e)
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), f"values differ at {where}"
        if t is not None:
            assert r.sharding == t.sharding, f"{where}: {r.sharding} != {t.sharding}"


def roundtrip(tmp_path, state, target, step=1, **save_kw) -> Restored:
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(step, state, **save_kw)
    with CheckpointManager(tmp_path / "ckpt") as mgr:  # a fresh manager, as after a restart
        return mgr.restore(step, target=target)


# ------------------------------------------------------------------ layouts
def test_mesh_shape_4x2_to_2x4_to_8x1(tmp_path):
    ref = host_state()
    a = place(ref, named(mesh((4, 2))))
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, a)
        tb = target_like(ref, named(mesh((2, 4))))
        b = mgr.restore(1, target=tb).state
        assert_bitwise(b, ref, tb)
        mgr.save(2, b)
        tc = target_like(ref, named(mesh((8, 1))))
        c = mgr.restore(2, target=tc).state
        assert_bitwise(c, ref, tc)
        assert mgr.all_steps() == [1, 2]


def test_device_count_8_to_4_to_1(tmp_path):
    ref = host_state(1)
    devs = jax.devices()
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, place(ref, named(mesh((4, 2)))))
        t4 = target_like(ref, named(mesh((2, 2), devs[:4])))
        s4 = mgr.restore(1, target=t4).state
        assert_bitwise(s4, ref, t4)
        assert all(len(x.sharding.device_set) == 4 for x in jax.tree.leaves(s4))
        mgr.save(2, s4)
        t1 = target_like(ref, named(mesh((1, 1), devs[:1])))
        s1 = mgr.restore(2, target=t1).state
        assert_bitwise(s1, ref, t1)
        assert all(x.sharding.device_set == {devs[0]} for x in jax.tree.leaves(s1))
        # and back up from one device to eight
        mgr.save(3, s1)
        t8 = target_like(ref, named(mesh((8, 1))))
        assert_bitwise(mgr.restore(3, target=t8).state, ref, t8)


def test_fsdp_to_tensor_parallel_specs(tmp_path):
    ref = host_state(2)
    m = mesh((4, 2))
    fsdp = named(m, two_d=P("data", None), one_d=P("data"))
    tp = named(m, two_d=P(None, "model"), one_d=P("model"))
    target = target_like(ref, tp)
    restored = roundtrip(tmp_path, place(ref, fsdp), target)
    assert_bitwise(restored.state, ref, target)
    assert restored.state["params"]["embed"].sharding.spec == P(None, "model")


def _mpmd_layout(first: Mesh, second: Mesh):
    """Params and their moments of 'embed'/'dense' on ``first``, the rest on ``second``."""
    def layout(kp, x):
        path = jax.tree_util.keystr(kp)
        m = first if ("embed" in path or "dense" in path) else second
        return named(m)(kp, x)
    return layout


def test_mpmd_disjoint_submeshes_to_one_mesh_and_back(tmp_path):
    ref = host_state(3)
    devs = jax.devices()
    stage0, stage1 = mesh((2, 2), devs[:4]), mesh((2, 2), devs[4:])
    mpmd = _mpmd_layout(stage0, stage1)
    state = place(ref, mpmd)
    sets = {frozenset(d.id for d in x.sharding.device_set) for x in jax.tree.leaves(state)}
    assert frozenset({0, 1, 2, 3}) in sets and frozenset({4, 5, 6, 7}) in sets
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, state)
        t_spmd = target_like(ref, named(mesh((4, 2))))
        spmd = mgr.restore(1, target=t_spmd).state
        assert_bitwise(spmd, ref, t_spmd)
        mgr.save(2, spmd)
        t_back = target_like(ref, mpmd)
        assert_bitwise(mgr.restore(2, target=t_back).state, ref, t_back)
        info = mgr.info(1)
    assert len(info.meshes) == 2
    assert {m.device_ids for m in info.meshes} == {(0, 1, 2, 3), (4, 5, 6, 7)}


def _pipeline_state(seed: int, layers: int = 4) -> dict:
    rng = np.random.default_rng(seed)
    return {"layers": [{"w": rng.standard_normal((8, 8), dtype=np.float32),
                        "b": rng.standard_normal((8,), dtype=np.float32)} for _ in range(layers)],
            "step": np.asarray(7, np.int32)}


def _stages(n_stages: int, layers: int = 4):
    """Layer i on stage i * n_stages // layers; each stage a (data, model) mesh."""
    devs = jax.devices()
    per = len(devs) // n_stages
    meshes = [mesh((per // 2, 2) if per > 1 else (1, 1), devs[s * per:(s + 1) * per])
              for s in range(n_stages)]

    def layout(kp, x):
        first = kp[0].key if isinstance(kp[0], jax.tree_util.DictKey) else None
        m = meshes[kp[1].idx * n_stages // layers] if first == "layers" else meshes[-1]
        return named(m)(kp, x)
    return layout


def test_pipeline_2_stages_to_4_stages_to_one_device(tmp_path):
    ref = _pipeline_state(4)
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, place(ref, _stages(2)))
        t4 = target_like(ref, _stages(4))
        s4 = mgr.restore(1, target=t4).state
        assert_bitwise(s4, ref, t4)
        assert len({frozenset(x.sharding.device_set) for x in jax.tree.leaves(s4)}) == 4
        mgr.save(2, s4)
        one = SingleDeviceSharding(jax.devices()[0])
        t1 = abstract_target(ref, one)
        assert_bitwise(mgr.restore(2, target=t1).state, ref, t1)


def test_prng_keys_round_trip_typed_and_raw(tmp_path):
    ref = host_state(5)
    state = place(ref, named(mesh((4, 2))))
    target = target_like(ref, named(mesh((2, 4))))
    out = roundtrip(tmp_path, state, target).state
    assert jax.dtypes.issubdtype(out["rng"].dtype, jax.dtypes.prng_key)
    assert str(out["rng"].dtype) == str(ref["rng"].dtype)
    assert out["raw_rng"].dtype == np.uint32
    assert out["batch_keys"].sharding.spec == P("data")
    assert_bitwise(out, ref, target)
    # the restored key continues the same random stream
    assert np.array_equal(jax.random.bits(out["rng"], (4,)), jax.random.bits(ref["rng"], (4,)))


def test_restore_target_may_be_arrays(tmp_path):
    ref = _pipeline_state(6)
    target = place(jax.tree.map(np.zeros_like, ref), named(mesh((2, 4))))
    out = roundtrip(tmp_path, place(ref, named(mesh((4, 2)))), target)
    assert_bitwise(out.state, ref, target)


def test_abstract_target_from_eval_shape_and_prefix_shardings():
    m = mesh((4, 2))
    abstract = jax.eval_shape(lambda: {"a": jax.numpy.zeros((8, 4)), "b": {"c": jax.numpy.zeros(3)}})
    t = abstract_target(abstract, {"a": NamedSharding(m, P("data")), "b": NamedSharding(m, P())})
    assert t["a"].shape == (8, 4) and t["a"].sharding.spec == P("data")
    assert t["b"]["c"].sharding == NamedSharding(m, P())
    with pytest.raises(TypeError, match="Sharding"):
        abstract_target(abstract, {"a": P("data"), "b": NamedSharding(m, P())})


# --------------------------------------------------------------- metadata
@dataclasses.dataclass
class _Cfg:
    layers: int
    dims: tuple


def test_metadata_and_data_position_round_trip(tmp_path):
    m = mesh((4, 2))
    meta = {"model": _Cfg(2, (8, 16)), "mesh": m, "rules": [("batch", "data"), ("mlp", "model")],
            "spec": P("data", None), "lr": np.float32(0.5), 3: "int key"}
    pos = {"epoch": 2, "index": np.int64(1234)}
    state = place(_pipeline_state(7), named(m))
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(5, state, metadata=meta, data_position=pos)
        info = mgr.info()  # waits for the save, reads no array
    assert info.step == 5
    assert info.metadata == {"model": {"layers": 2, "dims": [8, 16]},
                             "mesh": {"axis_names": ["data", "model"], "shape": [4, 2]},
                             "rules": [["batch", "data"], ["mlp", "model"]],
                             "spec": ["data", None], "lr": 0.5, "3": "int key"}
    assert info.data_position == {"epoch": 2, "index": 1234}
    rec = {r.path: r for r in info.leaves}
    assert rec["layers/0/w"].shape == (8, 8) and rec["layers/0/w"].dtype == "float32"
    assert rec["layers/0/w"].sharding == {"kind": "named", "mesh": 0, "spec": ["data", "model"]}
    restored = roundtrip(tmp_path / "again", state, target_like(state, named(m)), step=5,
                         metadata=meta, data_position=pos)
    assert restored.metadata == info.metadata and restored.data_position == pos
    assert restored.step == 5


def test_to_json_safe_rules():
    out = to_json_safe({"t": (1, 2.5, None), "s": {3, 1}, "nan": float("nan"),
                        "arr": np.arange(3), "obj": object, "p": P(("a", "b"), None)})
    assert out["t"] == [1, 2.5, None] and out["s"] == [1, 3] and out["nan"] == "nan"
    assert out["arr"] == [0, 1, 2] and out["p"] == [["a", "b"], None]
    assert out["obj"] == "builtins.object"
    json.dumps(out)


# ------------------------------------------------------- manager behaviour
def test_relative_directory_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ref = _pipeline_state(8)
    with CheckpointManager("rel/ckpt") as mgr:
        assert mgr.directory == str(tmp_path / "rel" / "ckpt")
        mgr.save(1, place(ref, named(mesh((4, 2)))))
    assert os.path.isdir(tmp_path / "rel" / "ckpt" / "1")
    monkeypatch.chdir("/")
    with CheckpointManager(tmp_path / "rel" / "ckpt") as mgr:
        target = target_like(ref, named(mesh((8, 1))))
        assert_bitwise(mgr.restore(target=target).state, ref, target)


def test_saving_an_existing_step_raises(tmp_path, monkeypatch):
    state = place(_pipeline_state(9), named(mesh((4, 2))))
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(3, state)
        with pytest.raises(CheckpointExistsError, match=r"step 3 already exists.*delete\(3\)"):
            mgr.save(3, state)  # still in flight, or done: either way an error
        mgr.wait_until_finished()
        with pytest.raises(FileExistsError, match="another step"):
            mgr.save(3, state)
        mgr.delete(3)
        assert mgr.all_steps() == []
        mgr.save(3, state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]
    # after a restart too, and the error names the absolute directory given relatively
    monkeypatch.chdir(tmp_path)
    with (CheckpointManager("c") as mgr,
          pytest.raises(CheckpointExistsError, match="step 3 already exists in " + re.escape(f"{tmp_path}/c;"))):
        mgr.save(3, state)


def test_keeps_last_n_and_finds_latest(tmp_path):
    state = place(_pipeline_state(10), named(mesh((4, 2))))
    with CheckpointManager(tmp_path / "c", max_to_keep=2) as mgr:
        assert mgr.latest_step() is None and mgr.all_steps() == []
        for step in (10, 20, 30, 40):
            mgr.save(step, state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [30, 40] and mgr.latest_step() == 40
    assert sorted(os.listdir(tmp_path / "c")) == ["30", "40"]
    with CheckpointManager(tmp_path / "c", max_to_keep=2) as mgr:
        assert mgr.all_steps() == [30, 40]
        assert mgr.restore(target=target_like(state, named(mesh((2, 4))))).step == 40


def test_in_flight_save_is_not_listed_until_committed(tmp_path):
    m = mesh((4, 2))
    big = {"w": jax.device_put(np.random.default_rng(0).standard_normal((4096, 2048), dtype=np.float32),
                               NamedSharding(m, P("data", "model")))}
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, big)
        listed, in_flight = mgr.all_steps(), mgr.pending_step
        committed = os.path.isdir(tmp_path / "c" / "1")
        # whatever the timing, a listed step is committed on disk
        if 1 in listed:
            assert committed
        if in_flight == 1:
            assert 1 not in listed and "saving=1" in repr(mgr)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1] and mgr.pending_step is None


def test_synchronous_save(tmp_path):
    state = place(_pipeline_state(11), named(mesh((4, 2))))
    with CheckpointManager(tmp_path / "c", async_save=False) as mgr:
        mgr.save(1, state)
        assert mgr.pending_step is None and mgr.all_steps() == [1]
        assert os.path.isdir(tmp_path / "c" / "1")


def test_missing_step_and_empty_directory_errors(tmp_path):
    target = target_like(_pipeline_state(12), named(mesh((4, 2))))
    with (CheckpointManager(tmp_path / "empty") as mgr,
          pytest.raises(FileNotFoundError, match=r"no complete checkpoint in .*empty")):
        mgr.restore(target=target)
    state = place(_pipeline_state(12), named(mesh((4, 2))))
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, state)
        with pytest.raises(FileNotFoundError, match=r"step 7 in .*c; complete steps: \[1\]"):
            mgr.restore(7, target=target)


def test_target_mismatch_lists_every_difference(tmp_path):
    ref = _pipeline_state(13)
    state = place(ref, named(mesh((4, 2))))
    target = target_like(ref, named(mesh((4, 2))))
    target["layers"][0]["w"] = jax.ShapeDtypeStruct((16, 8), np.float32, sharding=target["layers"][0]["w"].sharding)
    target["layers"][1]["b"] = jax.ShapeDtypeStruct((8,), jax.numpy.bfloat16, sharding=target["layers"][1]["b"].sharding)
    del target["layers"][2]["b"]
    target["extra"] = target["step"]
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, state)
        with pytest.raises(CheckpointMismatchError) as err:
            mgr.restore(1, target=target)
    e = err.value
    assert isinstance(e, ValueError)
    msg = str(e)
    assert "missing from target (saved in checkpoint): layers/2/b" in msg
    assert "unexpected in target (not in checkpoint): extra" in msg
    assert "shape mismatch at layers/0/w: saved (8, 8), target (16, 8)" in msg
    assert "dtype mismatch at layers/1/b: saved float32, target bfloat16" in msg
    assert e.missing and e.unexpected and len(e.mismatched) == 2


def test_target_sharding_that_does_not_divide_a_leaf_names_it(tmp_path):
    """A target sharding that cannot lay out a saved shape (30 rows over 8
    devices) is a mismatch naming the leaf, its shape and the sharding, found
    before any array is read (it used to be jax's IndivisibleError, without
    the leaf)."""
    rows = np.arange(30 * 4, dtype=np.float32).reshape(30, 4)
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, {"layer": {"w": jax.device_put(rows, NamedSharding(mesh((4, 2)), P()))}})
    eight = NamedSharding(mesh((8, 1)), P("data"))
    target = {"layer": {"w": jax.ShapeDtypeStruct((30, 4), np.float32, sharding=eight)}}
    with CheckpointManager(tmp_path / "c") as mgr:
        with pytest.raises(CheckpointMismatchError) as err:
            mgr.restore(1, target=target)
        msg = str(err.value)
        assert re.search(r"sharding mismatch at layer/w: saved shape \(30, 4\), target NamedSharding\(.*"
                         r"'data': 8.*P\('data',\).* does not divide it \(array axis 0 is partitioned 8 "
                         r"times, but the dimension size is 30\)", msg), msg
        assert [m[:2] for m in err.value.mismatched] == [("layer/w", "sharding")]
        ok = {"layer": {"w": jax.ShapeDtypeStruct((30, 4), np.float32,
                                                  sharding=NamedSharding(mesh((2, 4)), P(None, "model")))}}
        assert np.array_equal(np.asarray(mgr.restore(1, target=ok).state["layer"]["w"]), rows)


def test_targets_need_shardings_and_states_need_arrays(tmp_path):
    ref = _pipeline_state(14)
    with CheckpointManager(tmp_path / "c") as mgr:
        with pytest.raises(TypeError, match=r"jax.Array.*step \(int\)"):
            mgr.save(1, {**place(ref, named(mesh((4, 2)))), "step": 5})
        mgr.save(1, place(ref, named(mesh((4, 2)))))
        no_sharding = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ref)
        with pytest.raises(TypeError, match="without a sharding"):
            mgr.restore(1, target=no_sharding)
        with pytest.raises(TypeError, match=r"step \(ndarray\)"):
            mgr.restore(1, target={**target_like(ref, named(mesh((4, 2)))), "step": ref["step"]})
        with pytest.raises(ValueError, match=">= 0"):
            mgr.save(-1, place(ref, named(mesh((4, 2)))))


def test_repr_close_and_context_manager(tmp_path):
    state = place(_pipeline_state(15), named(mesh((4, 2))))
    mgr = CheckpointManager(tmp_path / "c", max_to_keep=5)
    mgr.save(1, state)
    mgr.wait_until_finished()
    text = repr(mgr)
    assert str(tmp_path / "c") in text and "steps=[1]" in text and "max_to_keep=5" in text
    mgr.close()
    mgr.close()  # idempotent
    assert "closed" in repr(mgr)
    with pytest.raises(RuntimeError, match="closed"):
        mgr.save(2, state)


def test_read_only_manager_does_not_create_or_write(tmp_path):
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, place(_pipeline_state(16), named(mesh((4, 2)))))
    with CheckpointManager(tmp_path / "c", read_only=True) as ro:
        assert ro.all_steps() == [1]
        with pytest.raises(PermissionError):
            ro.save(2, place(_pipeline_state(16), named(mesh((4, 2)))))
    assert sorted(os.listdir(tmp_path / "c")) == ["1"]


# ---------------------------------------------------------------- checksum
def test_checksum_is_layout_independent_and_sees_one_element():
    x = np.random.default_rng(0).standard_normal((16, 4, 8), dtype=np.float32)
    layouts = [NamedSharding(mesh((4, 2)), P("data", None, "model")),
               NamedSharding(mesh((2, 4)), P(None, "data", "model")),
               NamedSharding(mesh((8, 1)), P()),
               SingleDeviceSharding(jax.devices()[3])]
    sums = checksums([jax.device_put(x, s) for s in layouts])
    assert len(set(sums)) == 1
    y = x.copy()
    y[5, 1, 3] = np.nextafter(y[5, 1, 3], np.float32(np.inf))
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    other = checksums([jax.device_put(y, layouts[0]), jax.device_put(swapped, layouts[1])])
    assert sums[0] not in other


_DTYPES = [np.float32, jax.numpy.bfloat16, np.int8, np.uint16, np.int32, bool]
# layouts that cut rows and words anywhere: odd column starts (6 split in 2),
# rows longer than a hashing block (70,000 words), 1-D, a scalar; meshes are
# (shape, axis names)
_M42, _M24, _M23 = ((4, 2), ("data", "model")), ((2, 4), ("data", "model")), ((2, 3), ("model", "data"))
_LAYOUTS = [((16, 4, 6), [(_M42, P("data", None, "model")), (_M24, P(None, "model")),
                          (_M23, P("model", None, "data"))]),
            ((4, 70_000), [(_M42, P("data", "model")), (_M24, P(None, "model")), (_M42, P())]),
            ((48,), [(_M42, P(("data", "model"))), (_M23, P(("model", "data")))]),
            ((), [(_M42, P())])]


# float32 and bfloat16 in the default suite; the integer and bool widths (7 to 10 s each) with -m slow
@pytest.mark.parametrize("dtype", [d if d in (np.float32, jax.numpy.bfloat16) else
                                   pytest.param(d, marks=pytest.mark.slow) for d in _DTYPES],
                         ids=lambda d: np.dtype(d).name)
def test_checksum_same_on_every_layout_on_host_and_on_device(dtype):
    """Format 2 adds per-shard parts: the sum must not depend on where the
    shards are cut, nor on whether a shard is hashed by host threads (CPU
    shards) or by the jitted kernel (accelerator shards; forced here)."""
    rng = np.random.default_rng(3)
    for shape, layouts in _LAYOUTS:
        x = (rng.integers(0, 2, size=shape).astype(bool) if dtype is bool
             else rng.integers(-100, 100, size=shape).astype(dtype))
        got = {checksums([jax.device_put(x, jax.devices()[2])])[0]}
        for (mshape, names), spec in layouts:
            a = jax.device_put(x, NamedSharding(mesh(mshape, names=names), spec))
            for on_device in (False, True):
                got.add(ckpt_checksum.finish(ckpt_checksum.start([a], on_device=on_device))[0])
        assert len(got) == 1, (np.dtype(dtype).name, shape, got)
        flat = x.reshape(-1).copy()  # any single changed word is seen
        i = flat.size * 2 // 3
        flat[i] = ~flat[i] if dtype is bool else flat[i] + 1
        assert checksums([jax.device_put(flat.reshape(shape), jax.devices()[0])])[0] not in got


def test_checksum_of_many_small_leaves_is_batched_consistently():
    """Small blocks are hashed in batches of the same shape; the values equal
    those of blocks hashed alone, and each leaf keeps its own."""
    rng = np.random.default_rng(4)
    leaves = [rng.standard_normal((8, 16), dtype=np.float32) for _ in range(50)]
    spread = [jax.device_put(v, NamedSharding(mesh((4, 2)), P("data", "model"))) for v in leaves]
    alone = [ckpt_checksum.host_sum(v, ((0, 8), (0, 16)), (8, 16)) for v in leaves]
    assert checksums(spread) == [f"{v:016x}" for v in alone]
    assert len(set(alone)) == len(alone)


def test_format_1_checksum_is_unchanged():
    """Checkpoints written before format 2 carry format-1 checksums; the value
    below was computed by the format-1 code of commit 3c14436."""
    x = np.random.default_rng(0).standard_normal((16, 4, 8), dtype=np.float32)
    a = jax.device_put(x, NamedSharding(mesh((4, 2)), P("data", None, "model")))
    assert ckpt_checksum.checksums_v1([a]) == ["9b942c20c83dfad5"]


def test_save_hashes_while_writing_and_records_every_leaf(tmp_path, monkeypatch):
    """With async saves the checksums are computed in the background and land
    in the document at commit; the arrays may be deleted once save returns."""
    ref = host_state(8)
    state = place(ref, named(mesh((4, 2))))
    leaves = leaves_with_paths(state)
    expected = dict(zip([p for p, _ in leaves], checksums([x for _, x in leaves])))
    started = []
    real_start = ckpt_checksum.start
    monkeypatch.setattr(ckpt_checksum, "start", lambda arrays, **kw: (
        started.append(len(arrays)), real_start(arrays, **kw))[1])
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, state)
        for x in jax.tree.leaves(state):
            x.delete()
        mgr.wait_until_finished()
        info = mgr.info(1)
    assert started == [len(leaves)]
    assert info.format == "multimesh-checkpoint/2"
    assert info.checksum_algorithm == ckpt_checksum.ALGORITHM
    assert {r.path: r.checksum for r in info.leaves} == expected
    ref = host_state(8)  # the deleted arrays included ref's own keys (device_put kept them)
    with CheckpointManager(tmp_path / "c") as mgr:
        target = target_like(ref, named(mesh((2, 4))))
        assert_bitwise(mgr.restore(1, target=target).state, ref, target)


@pytest.mark.parametrize("whole_leaf_bytes", [0, 1 << 30], ids=["per-shard", "whole-leaf"])
def test_restore_hashes_on_the_read_path(tmp_path, monkeypatch, whole_leaf_bytes):
    """Arrays are read by our lean path (per shard, or whole small leaves) and
    hashed as they arrive; only what Orbax reads (typed PRNG keys) is hashed
    after the restore."""
    monkeypatch.setattr(ckpt_handlers, "WHOLE_LEAF_BYTES", whole_leaf_bytes)
    ref = host_state(9)
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, place(ref, named(mesh((4, 2)))))
    after = []
    real_start = ckpt_checksum.start
    monkeypatch.setattr(ckpt_checksum, "start", lambda arrays, **kw: (
        after.extend(str(x.dtype) for x in arrays), real_start(arrays, **kw))[1])
    replicated = NamedSharding(mesh((2, 4)), P())
    target = target_like(ref, lambda kp, x: replicated if np.ndim(x) == 2 else named(mesh((2, 4)))(kp, x))
    with CheckpointManager(tmp_path / "c") as mgr:
        out = mgr.restore(1, target=target).state
    assert_bitwise(out, ref, target)
    assert after and all(d.startswith("key<") for d in after), after
    # replicas may share the host buffer they were read into (as after
    # jax.device_put); donating one array must not change another
    embed, kernel = out["params"]["embed"], out["params"]["dense"]["kernel"]
    doubled = jax.jit(lambda x: x * 2, donate_argnums=0)(embed)
    assert np.array_equal(np.asarray(doubled), 2 * ref["params"]["embed"])
    assert np.array_equal(np.asarray(kernel), ref["params"]["dense"]["kernel"])


def test_compression_is_an_option_and_both_kinds_restore(tmp_path):
    x = (np.arange(256 * 512) % 7).astype(np.float32).reshape(256, 512)  # compresses well
    state = {"x": jax.device_put(x, NamedSharding(mesh((4, 2)), P("data", "model")))}
    sizes = {}
    for compression in (False, True):
        d = tmp_path / f"c{compression}"
        with CheckpointManager(d, compression=compression) as mgr:
            mgr.save(1, state)
        sizes[compression] = sum(f.stat().st_size for f in (d / "1" / "state").rglob("*") if f.is_file())
        with CheckpointManager(d) as mgr:
            out = mgr.restore(1, target=abstract_target(state, NamedSharding(mesh((8, 1)), P("data"))))
        assert np.array_equal(np.asarray(out.state["x"]), x)
    assert sizes[False] > x.nbytes > 4 * sizes[True], sizes


def test_raw_orbax_reads_our_checkpoints(tmp_path):
    """Same files and step metadata as Orbax's own handlers write."""
    ref = _pipeline_state(10)
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, place(ref, named(mesh((4, 2)))))
    meta = json.loads((tmp_path / "c" / "1" / "_CHECKPOINT_METADATA").read_text())
    assert meta["item_handlers"] == {"state": ocp.StandardCheckpointHandler.typestr(),
                                     "multimesh": ocp.JsonCheckpointHandler.typestr()}
    target = target_like(ref, named(mesh((2, 4))))
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(tmp_path / "c", options=options) as raw:
        out = raw.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    assert_bitwise(out["state"], ref, target)


# ---------------------------------------------------------------- inspector
def test_inspector_lists_steps_and_describes_one(tmp_path, capsys):
    m = mesh((4, 2))
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, place(host_state(17), named(m)), metadata={"model": {"d": 8}},
                 data_position=42)
        mgr.save(2, place(host_state(17), named(m)))
    os.makedirs(tmp_path / "c" / "3.orbax-checkpoint-tmp" / "state")

    assert ckpt_inspect.main([str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()[:1].isdigit()}
    assert set(lines) == {"1", "2", "3"}
    assert "complete" in lines["1"] and "partial" in lines["3"]
    assert "KiB" in lines["1"]
    assert "latest complete step: 2" in out

    assert ckpt_inspect.main([str(tmp_path / "c"), "1"]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("params/embed "))
    assert "(16, 8)" in row and "float32" in row and "mesh0 P('data', 'model')" in row
    assert "bfloat16" in out and "key<fry>" in out
    assert "mesh0: data=4 x model=2 on devices 0-7" in out
    assert "data position: 42" in out and '"d": 8' in out

    assert ckpt_inspect.main([str(tmp_path / "c"), "3"]) == 1
    assert "unfinished saves ignored: [3]" in capsys.readouterr().err
    assert ckpt_inspect.main([str(tmp_path / "nowhere")]) == 2
    assert not os.path.exists(tmp_path / "nowhere")


def test_inspector_given_a_run_directory_reads_its_checkpoints(tmp_path, capsys):
    """``multimesh-ckpt runs/tiny`` (the trainer's out_dir) lists ``runs/tiny/checkpoints``, saying so."""
    with CheckpointManager(tmp_path / "run" / "checkpoints") as mgr:
        mgr.save(5, place(host_state(3), named(mesh((4, 2)))))
    assert ckpt_inspect.main([str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    assert "latest complete step: 5" in captured.out
    assert f"reading {tmp_path / 'run' / 'checkpoints'}" in captured.err
    assert ckpt_inspect.main([str(tmp_path / "run"), "latest"]) == 0
    assert "checkpoint step 5" in capsys.readouterr().out


def test_nnx_objects_save_and_restore_as_objects_onto_another_layout(tmp_path):
    """An NNX state kept as the objects themselves, ``(model, optimizer)`` with an ``nnx.List`` of blocks, comes
    back as objects on the target's layout (Orbax alone cannot read those key paths back)."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(8, 16, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])

    def make():
        model = Model(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    devices = np.asarray(jax.devices())
    mesh = Mesh(devices.reshape(4, 2), ("data", "model"))
    state = jax.device_put(make(), NamedSharding(mesh, P()))
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, state)
    one = SingleDeviceSharding(jax.devices()[0])
    with CheckpointManager(str(tmp_path)) as mgr:
        restored = mgr.restore(1, target=abstract_target(jax.eval_shape(make), one)).state
    model, optimizer = restored
    assert isinstance(model, nnx.Module) and isinstance(optimizer, nnx.Optimizer)
    assert model.blocks[1].up.kernel[...].sharding == one
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert [p for p, _ in leaves_with_paths(restored)] == [p for p, _ in leaves_with_paths(state)]


def test_a_prng_key_in_metadata_is_stored_as_its_key_data(tmp_path):
    key = jax.random.key(7)
    state = {"w": jax.device_put(np.arange(4.0, dtype=np.float32))}
    with CheckpointManager(str(tmp_path), async_save=False) as mgr:
        mgr.save(0, state, metadata={"rng": key, "seed": 7})
        info = mgr.info(0)
    assert info.metadata == {"rng": np.asarray(jax.random.key_data(key)).tolist(), "seed": 7}
