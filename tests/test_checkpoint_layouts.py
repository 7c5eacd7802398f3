"""Checkpoints through `parallelize`: train on one layout, restore onto another.

A 4-block residual MLP (Linen, logical names) trained with optax adam. The
checkpointed state is everything a restart needs: params, adam state, a step
counter and the RNG key (arrays, laid out by `parallelize` with the rest), the
data position and metadata naming the mesh, rules and layout. The same
program runs as SPMD (one mesh, rules) or MPMD (blocks grouped into stages,
one task per stage on its own submesh); the state tree is the same in every
layout, so any checkpoint restores onto any layout with
``target=step_fn.abstract_params`` (or ``target=step_fn``).

Every restore is checked leaf by leaf against the bits actually saved, and the
arrays' ``.sharding`` against the new step function's ``param_shardings``.
The layout-to-layout (device_put) versions of these moves, and the manager's
own behaviour, are in test_checkpoint.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import MLP

from multimesh.checkpoint import CheckpointManager, to_json_safe
from multimesh.checkpoint.tree import leaves_with_paths
from multimesh.jax import build_mesh, parallelize, task

pytestmark = pytest.mark.devices(8)

BLOCKS, BATCH, EMBED = 4, 16, 16
SAVE_AT, STEPS = 3, 6  # the checkpoint is taken after SAVE_AT steps; runs go on to STEPS
MODEL = MLP(hidden=32, features=EMBED)
TX = optax.adam(1e-2)
TWO_D = (("batch", "data"), ("mlp", "model"))


@dataclass(frozen=True)
class Layout:
    """How `parallelize` lays the state out: a mesh and rules (SPMD), or
    ``stages`` tasks, each on ``8 // stages`` devices with 2-D rules (MPMD)."""

    name: str
    mesh: dict | None = None
    rules: tuple = TWO_D
    devices: int = 8
    stages: int = 0


L4x2 = Layout("spmd 4x2", {"data": 4, "model": 2})
L2x4 = Layout("spmd 2x4", {"data": 2, "model": 4})
L8x1 = Layout("spmd 8x1", {"data": 8, "model": 1})
L4DEV = Layout("spmd 2x2 on 4 devices", {"data": 2, "model": 2}, devices=4)
L1DEV = Layout("spmd 1 device", {"data": 1, "model": 1}, devices=1)
FSDP = Layout("fsdp 8", {"data": 8}, rules=(("batch", "data"), ("embed", "data")))
TP = Layout("tensor parallel 8", {"model": 8}, rules=(("mlp", "model"),))
STAGES1, STAGES2, STAGES4 = (Layout(f"mpmd {n} stages", stages=n) for n in (1, 2, 4))


# ------------------------------------------------------------------- the program
def init_state() -> dict:
    keys = jax.random.split(jax.random.key(0), BLOCKS)
    x = jnp.zeros((BATCH, EMBED))
    params = {f"b{i}": MODEL.init(keys[i], x) for i in range(BLOCKS)}
    return {"params": params, "opt": TX.init(params), "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key(1)}


def batch_at(position: int) -> dict[str, np.ndarray]:
    """The batch at a data position (a restart continues from the saved one)."""
    rs = np.random.RandomState(position)
    return {"x": rs.randn(BATCH, EMBED).astype(np.float32),
            "y": rs.randn(BATCH, EMBED).astype(np.float32)}


def blocks(params: dict, x: jax.Array) -> jax.Array:
    for name in sorted(params):
        x = x + MODEL.apply(params[name], x)
    return x


def make_step(stages: list[tuple[list[int], Callable]]) -> Callable:
    """One adam step; the RNG key drives input noise, so a wrong key shows."""

    def step(state, batch):
        rng, sub = jax.random.split(state["rng"])
        x = batch["x"] + 0.1 * jax.random.normal(sub, batch["x"].shape)

        def loss(params):
            h = x
            for ids, run in stages:
                h = run({f"b{i}": params[f"b{i}"] for i in ids}, h)
            return jnp.mean((h - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt": opt,
                       "step": state["step"] + 1, "rng": rng}

    return step


def stage_tasks(n: int) -> list[tuple[list[int], Callable]]:
    """Blocks split evenly over ``n`` tasks on disjoint submeshes of the 8 devices."""
    devs, per = np.array(jax.devices()), 8 // n
    shape = {"data": 2, "model": per // 2}
    return [(list(range(s * BLOCKS // n, (s + 1) * BLOCKS // n)),
             task(blocks, f"stage{s}", mesh=build_mesh(shape, devs[s * per:(s + 1) * per]),
                  logical_axes=TWO_D))
            for s in range(n)]


def build(layout: Layout):
    """``(step_fn, sharded_init)`` of the program on ``layout``."""
    if layout.stages:
        fn, init, _ = parallelize(make_step(stage_tasks(layout.stages)), init_params=init_state,
                                  get_input_batch=lambda: batch_at(0))
    else:
        fn, init, _ = parallelize(make_step([(list(range(BLOCKS)), blocks)]), init_params=init_state,
                                  get_input_batch=lambda: batch_at(0), mesh=layout.mesh,
                                  rules=list(layout.rules), devices=jax.devices()[:layout.devices])
    return fn, init


def train(fn, state: dict, start: int, stop: int, on_step: Callable | None = None) -> dict:
    """Steps ``start..stop-1`` on batches ``start..``; blocks on every loss (XLA:CPU
    aborts when too many executions with collectives are queued)."""
    for position in range(start, stop):
        loss, state = fn(state, batch_at(position))
        jax.block_until_ready(loss)
        if on_step is not None:
            on_step(position + 1, state)
    return state


def metadata(layout: Layout) -> dict:
    return {"layout": layout.name, "mesh": layout.mesh, "rules": layout.rules,
            "devices": layout.devices, "stages": layout.stages}


# ------------------------------------------------------------------- checks
def host(tree: Any) -> dict[str, tuple[str, np.ndarray]]:
    """``{path: (dtype, host copy)}``; typed PRNG keys as their key data."""
    out = {}
    for path, x in leaves_with_paths(tree):
        raw = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        out[path] = (str(x.dtype), np.asarray(raw))
    return out


def assert_restored(state: Any, saved: dict, fn, before: Any) -> None:
    """Bit for bit what was saved, on ``fn``'s layout (read off the arrays),
    and every leaf moved: ``before`` (the saved arrays) had another sharding."""
    assert jax.tree.structure(state) == jax.tree.structure(fn.abstract_params)
    got = host(state)
    assert got.keys() == saved.keys()
    for path, (dtype, value) in saved.items():
        assert got[path][0] == dtype, path
        assert got[path][1].tobytes() == value.tobytes(), f"values differ at {path}"
    want = jax.tree.leaves(fn.param_shardings)
    old = jax.tree.leaves(before)
    for (path, x), s, b in zip(leaves_with_paths(state), want, old, strict=True):
        assert isinstance(x, jax.Array), path
        assert x.sharding == s, f"{path}: restored on {x.sharding}, the new layout is {s}"
        assert x.sharding != b.sharding, f"{path}: layout did not change ({b.sharding})"


def assert_state_close(got: Any, want: dict, *, exact: bool) -> None:
    """Floats bitwise (``exact``) or to rtol 1e-5; counters and keys always exactly."""
    got = host(got)
    assert got.keys() == want.keys()
    for path, (dtype, value) in want.items():
        assert got[path][0] == dtype, path
        if exact or not np.issubdtype(value.dtype, np.floating):
            assert got[path][1].tobytes() == value.tobytes(), f"values differ at {path}"
        else:
            np.testing.assert_allclose(got[path][1], value, rtol=1e-5, atol=1e-6, err_msg=path)


# ------------------------------------------------------------------- sources
def run_and_save(layout: Layout, directory, stop: int) -> SimpleNamespace:
    """Trains on ``layout`` to ``stop``, saving step SAVE_AT asynchronously while
    training goes on (the wait comes when the manager closes)."""
    fn, init = build(layout)
    kept = {}

    def save(step: int, state: dict) -> None:
        if step == SAVE_AT:
            kept.update(saved=host(state), arrays=state)
            mgr.save(step, state, metadata=metadata(layout), data_position=step)

    with CheckpointManager(directory) as mgr:
        final = train(fn, init(), 0, stop, save)
    return SimpleNamespace(layout=layout, fn=fn, dir=directory, final=host(final), **kept)


@pytest.fixture(scope="module")
def spmd_run(tmp_path_factory) -> SimpleNamespace:
    """The uninterrupted run on 4x2, with its checkpoint at SAVE_AT."""
    return run_and_save(L4x2, tmp_path_factory.mktemp("spmd") / "ckpt", STEPS)


@pytest.fixture(scope="module")
def mpmd_run(tmp_path_factory) -> SimpleNamespace:
    """Two stages on 4 devices each, to SAVE_AT and its checkpoint."""
    return run_and_save(STAGES2, tmp_path_factory.mktemp("mpmd") / "ckpt", SAVE_AT)


def hop(src_dir, step: int, layout: Layout, saved: dict, before: Any, dst_dir, *, whole: bool = False):
    """Restores ``step`` onto ``layout`` (checked), saves it again in ``dst_dir``
    as step ``step + 1`` and returns what the next hop needs."""
    fn, _ = build(layout)
    with CheckpointManager(src_dir, read_only=True) as mgr:
        state = mgr.restore(step, target=fn if whole else fn.abstract_params).state
    assert_restored(state, saved, fn, before)
    with CheckpointManager(dst_dir) as mgr:
        mgr.save(step + 1, state, metadata=metadata(layout), data_position=step)
    return dst_dir, step + 1, state


def chain(source: SimpleNamespace, layouts: list[Layout], tmp_path) -> None:
    where, step, before = source.dir, SAVE_AT, source.arrays
    for i, layout in enumerate(layouts):
        where, step, before = hop(where, step, layout, source.saved, before, tmp_path / f"hop{i}",
                                  whole=i % 2 == 1)


# ------------------------------------------------------------------- layouts
def test_mesh_shape_4x2_to_2x4_to_8x1(spmd_run, tmp_path):
    chain(spmd_run, [L2x4, L8x1], tmp_path)


def test_device_count_8_to_4_to_1(spmd_run, tmp_path):
    chain(spmd_run, [L4DEV, L1DEV], tmp_path)


def test_rules_fsdp_to_tensor_parallel(spmd_run, tmp_path):
    kernel = "params/b0/params/Dense_0/kernel/value"  # ('embed', 'mlp')
    for layout, spec in ((FSDP, ("data", None)), (TP, (None, "model"))):
        fn, _ = build(layout)
        assert tuple(dict(leaves_with_paths(fn.param_shardings))[kernel].spec) == spec, layout.name
    chain(spmd_run, [FSDP, TP], tmp_path)


def test_mpmd_stages_to_one_mesh_and_back(mpmd_run, tmp_path):
    with CheckpointManager(mpmd_run.dir, read_only=True) as mgr:
        info = mgr.info(SAVE_AT)
    # the checkpoint really held leaves on the two stages' disjoint submeshes
    assert sorted(m.device_ids for m in info.meshes) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert info.metadata == to_json_safe(metadata(STAGES2)) and info.data_position == SAVE_AT
    chain(mpmd_run, [L4x2, STAGES2], tmp_path)


def test_stage_count_2_to_4_to_1(mpmd_run, tmp_path):
    chain(mpmd_run, [STAGES4, STAGES1], tmp_path)


# ------------------------------------------------------------------- resume
@pytest.mark.parametrize("source, layout, exact", [
    ("spmd", L4x2, True),     # same layout: the interrupted run equals the uninterrupted one bitwise
    ("spmd", L8x1, False),    # another mesh shape: to float tolerance
    ("mpmd", L4x2, False),    # pipeline stages -> one SPMD mesh
], ids=["same-layout", "4x2-to-8x1", "mpmd-to-spmd"])
def test_resume_continues_the_run(request, spmd_run, source, layout, exact):
    src = request.getfixturevalue(f"{source}_run")
    fn, _ = build(layout)
    with CheckpointManager(src.dir, read_only=True) as mgr:
        restored = mgr.restore(target=fn.abstract_params)
    assert restored.step == SAVE_AT and restored.data_position == SAVE_AT
    assert restored.metadata == to_json_safe(metadata(src.layout))
    assert int(restored.state["step"]) == SAVE_AT
    final = train(fn, restored.state, restored.data_position, STEPS)
    assert int(final["step"]) == STEPS
    assert_state_close(final, spmd_run.final, exact=exact)


def test_step_function_as_a_subtree_of_the_target(spmd_run, tmp_path):
    """``target={"train": step_fn, ...}``: the function stands for its abstract_params."""
    fn, _ = build(L8x1)
    counter = jax.device_put(np.asarray(41, np.int32))
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, {"train": spmd_run.arrays, "epoch": counter})
        out = mgr.restore(1, target={"train": fn, "epoch": counter}).state
        with pytest.raises(TypeError, match=r"restore needs target=.*abstract_params"):
            mgr.restore(1, target=None)
    assert int(out["epoch"]) == 41
    assert_restored(out["train"], spmd_run.saved, fn, spmd_run.arrays)
