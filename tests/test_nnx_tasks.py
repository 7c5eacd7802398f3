"""Flax NNX models as they are: `register_task` by attribute path, in-place NNX steps, `parallelize_step`.

Every parallel run is compared with the same step on one device (losses of 3
optimizer steps and the final parameters); stage placement is checked on the
arrays and, for the backward, on the plan's equations.
"""

from __future__ import annotations

import functools
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import train_steps
from jax.sharding import PartitionSpec as P

from multimesh.jax import build_mesh, ignore_transforms, microbatch, mjit, parallelize, register_task
from multimesh.jax.flax import functional_step, parallelize_step, with_sharding_constraint
from multimesh.trace.implicit import is_backprop, names_in, scope_names
from multimesh.trace.nnx_scopes import StepScopes, module_scopes

D, HIDDEN, BLOCKS, BATCH = 8, 16, 4, 16
STEPS = 3
RULES = [("batch", "data"), ("mlp", "model")]


def _kernel(*names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, HIDDEN, kernel_init=_kernel("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(HIDDEN, D, kernel_init=_kernel("mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        h = with_sharding_constraint(nnx.relu(self.up(x)), P("batch", "mlp"))
        return self.down(h)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = Mlp(rngs)

    def __call__(self, x):
        return x + self.mlp(self.norm(x))


class Net(nnx.Module):
    """embed, blocks.0 .. blocks.3 (an nnx.List), head: an NNX model that opens no scope of its own."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Linear(4, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


TX = optax.adam(1e-2)
with nnx.use_eager_sharding(False):  # the graph only, abstractly: no mesh is needed for it
    GRAPHDEF, _ = nnx.split(nnx.eval_shape(lambda: Net(nnx.Rngs(0))), nnx.Param)


def init():
    params = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
    return {"params": params, "opt": TX.init(params)}


def get_batch():
    x = jax.random.normal(jax.random.key(1), (BATCH, 4))
    return {"x": x, "y": jnp.sin(x.sum(-1, keepdims=True))}


def loss_fn(params, batch):
    return jnp.mean((nnx.merge(GRAPHDEF, params)(batch["x"]) - batch["y"]) ** 2)


def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def _reference(step_fn, make_state, steps=STEPS):
    """``step_fn`` on one device, registrations and microbatching off: losses and final state."""
    def one_device(state, batch):
        with ignore_transforms():
            return step_fn(state, batch)

    with nnx.use_eager_sharding(False):  # NNX refuses logical sharding names outside a mesh otherwise
        state = jax.device_put(make_state(), jax.devices()[0])
    batch = jax.device_put(get_batch(), jax.devices()[0])
    run, losses = jax.jit(one_device), []
    for _ in range(steps):
        loss, state = run(state, batch)
        losses.append(float(loss))
    return losses, state


def _train(step_fn, init_fn, batch_fn, steps=STEPS):
    return train_steps(step_fn, init_fn, batch_fn, steps)


def _assert_same_params(got, want):
    got, want = jax.device_get(got), jax.device_get(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


FIRST, SECOND = range(0, 4), range(4, 8)


def _stages():
    devices = jax.devices()
    first = build_mesh({"data": 2, "model": 2}, devices[:4])
    second = build_mesh({"data": 2, "model": 2}, devices[4:])
    return (register_task(r"embed|blocks\.[01]", name="first", mesh=first, logical_axes=RULES),
            register_task(r"blocks\.[23]|head", name="second", mesh=second, logical_axes=RULES))


def _ids(array) -> set[int]:
    return {d.id for d in array.sharding.device_set}


def _check_placement(params):
    """Each submodule's parameters live on its stage's devices only; the MLP kernels are split over model=2."""
    for name, where in [("embed", FIRST), ("head", SECOND)]:
        for leaf in jax.tree.leaves(params[name]):
            assert _ids(leaf) == set(where), name
    for i in range(BLOCKS):
        where = FIRST if i < 2 else SECOND
        block = params["blocks"][i]
        for leaf in jax.tree.leaves(block):
            assert _ids(leaf) == set(where), f"blocks.{i}"
        up = block["mlp"]["up"]["kernel"][...]
        assert up.sharding.spec == P(None, "model")
        assert up.addressable_shards[0].data.shape == (D, HIDDEN // 2)


def _check_plan_directions(plan):
    """Every equation of blocks.i runs on its stage, forward and backward, and both directions occur."""
    seen = set()
    for seg in plan.segments:
        for e in seg.eqns:
            names = scope_names(e.source_info.name_stack)
            block = next((int(m.group(1)) for n in names if (m := re.fullmatch(r"blocks\.(\d)", n))), None)
            if block is None:
                continue
            want = "first" if block < 2 else "second"
            assert seg.placement.name == want, (block, names, seg.placement.name)
            seen.add((block, is_backprop(e.source_info.name_stack)))
    assert seen == {(b, d) for b in range(BLOCKS) for d in (False, True)}


def test_register_task_by_attribute_path_matches_one_device():
    a, b = _stages()
    with a, b:
        step_fn, init_fn, batch_fn = parallelize(step, init_params=init, get_input_batch=get_batch, strict=True)
    assert [p.name for p in step_fn.plan.placements] == ["first", "second"]
    _check_plan_directions(step_fn.plan)
    losses, state = _train(step_fn, init_fn, batch_fn)
    ref_losses, ref_state = _reference(step, init)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    _check_placement(state["params"])
    _assert_same_params(state["params"], ref_state["params"])


def test_mjit_finds_nnx_stages_too():
    """`mjit` (MultiMesh's jit) plans registered tasks as `parallelize` does: NNX paths are scopes there too."""
    a, b = _stages()
    with nnx.use_eager_sharding(False):
        params = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
    batch = get_batch()
    with a, b:
        fn = mjit(jax.value_and_grad(loss_fn))
        value, grads = fn(params, batch)
    assert [p.name for p in fn.plan.placements] == ["first", "second"]
    _check_plan_directions(fn.plan)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    _assert_same_params(grads, ref_grads)


def test_nested_paths_and_a_callback():
    """A registration may name a nested submodule by its whole path (``blocks.1.mlp``), and a callback
    receives the path: here each block's MLP goes to its own pair of devices, the rest stays SPMD."""
    def where(name, backprop):
        return (2 * int(name.group(1)), 2 * int(name.group(1)) + 2), f"mlp{name.group(1)}"

    with register_task(r"blocks\.(\d)\.mlp", callback=where):
        step_fn, init_fn, batch_fn = parallelize(step, init_params=init, get_input_batch=get_batch,
                                                 mesh={"data": 8}, rules=[("batch", "data")])
    names = {p.name for p in step_fn.plan.placements}
    assert {f"mlp{i}" for i in range(BLOCKS)} <= names
    losses, state = _train(step_fn, init_fn, batch_fn)
    ref_losses, ref_state = _reference(step, init)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for i in range(BLOCKS):
        assert _ids(state["params"]["blocks"][i]["mlp"]["up"]["kernel"][...]) == {2 * i, 2 * i + 1}
    _assert_same_params(state["params"], ref_state["params"])


def test_pipelined_with_microbatches():
    """The pipeline path: `microbatch` over the NNX loss, two stages by attribute path, 1F1B."""
    def pipelined_step(state, batch):
        summed = microbatch(loss_fn, 0, BATCH // 4, argnum=1, schedule="1f1b")  # sums the 4 microbatch means
        loss, grads = jax.value_and_grad(lambda p, b: summed(p, b) / 4)(state["params"], batch)
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    a, b = _stages()
    with a, b:
        step_fn, init_fn, batch_fn = parallelize(pipelined_step, init_params=init, get_input_batch=get_batch)
    assert step_fn.plan.schedule is not None
    assert [p.name for p in step_fn.plan.placements] == ["first", "second"]
    losses, state = _train(step_fn, init_fn, batch_fn)
    ref_losses, ref_state = _reference(step, init)  # the mean of 4 equal microbatch means: the batch mean
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _check_placement(state["params"])
    _assert_same_params(state["params"], ref_state["params"])


class RematNet(Net):
    """Net with each block run through ``nnx.remat``: the block called is a copy NNX makes (recorded by NNX
    in graph mode; in tree mode, or under ``jax.checkpoint``, one JAX's unflattening makes, linked to
    nothing, of a block whose three twins have its structure)."""

    remat = staticmethod(nnx.remat)

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = self.remat(lambda blk, y: blk(y))(block, h)
        return self.head(h)


REMATS = {"nnx.remat": nnx.remat, "nnx.remat, tree mode": functools.partial(nnx.remat, graph=False),
          "jax.checkpoint": jax.checkpoint}


def _remat_parts(microbatches: int | None, remat: str = "nnx.remat"):
    net = type("RematNet", (RematNet,), {"remat": staticmethod(REMATS[remat])})
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: net(nnx.Rngs(0))), nnx.Param)

    def loss(params, batch):
        return jnp.mean((nnx.merge(graphdef, params)(batch["x"]) - batch["y"]) ** 2)

    def remat_step(state, batch):
        if microbatches is None:
            value, grads = jax.value_and_grad(loss)(state["params"], batch)
        else:
            summed = microbatch(loss, 0, BATCH // microbatches, argnum=1, schedule="gpipe")
            value, grads = jax.value_and_grad(lambda p, b: summed(p, b) / microbatches)(state["params"], batch)
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    def remat_init():
        params = nnx.state(net(nnx.Rngs(0)), nnx.Param)
        return {"params": params, "opt": TX.init(params)}

    return remat_step, remat_init


@pytest.mark.parametrize("remat", list(REMATS))
@pytest.mark.parametrize("microbatches", [None, 2], ids=["whole-batch", "gpipe"])
def test_blocks_under_nnx_remat_keep_their_paths(microbatches, remat):
    """The copy ``nnx.remat`` (or ``jax.checkpoint``) makes of a block keeps the block's path; its
    recomputation runs on the block's stage, and under a pipeline schedule in the backward units (that is
    what remat is for). A copy no NNX context records is one of four twins, named by the parameters its
    equations read (`trace.twin_names`)."""
    remat_step, remat_init = _remat_parts(microbatches, remat)
    a, b = _stages()
    with a, b:
        step_fn, init_fn, batch_fn = parallelize(remat_step, init_params=remat_init, get_input_batch=get_batch,
                                                 strict=True)
    _check_plan_directions(step_fn.plan)
    recomputed = [seg for seg in step_fn.plan.segments for e in seg.eqns
                  if "rematted_computation" in str(e.source_info.name_stack)]
    assert recomputed
    if microbatches is not None:
        assert all(seg.unit is not None and seg.unit.backward for seg in recomputed)
    losses, state = _train(step_fn, init_fn, batch_fn)
    ref_losses, ref_state = _reference(step, init)  # remat changes no value
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _check_placement(state["params"])
    _assert_same_params(state["params"], ref_state["params"])


# -- the NNX idiom: nnx.Optimizer and a step that updates in place ---------------------------------


def train_step(model, optimizer, batch):
    def loss(model):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value


def make_objects():
    model = Net(nnx.Rngs(0))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def _params(model):
    return nnx.state(model, nnx.Param)


@pytest.mark.parametrize("mode", ["graph", "tree"])
@pytest.mark.parametrize("jitted", [False, True], ids=["plain", "nnx.jit"])
def test_in_place_step_through_functional_step(jitted, mode):
    """``train_step(model, optimizer, batch)`` (optionally `nnx.jit`-decorated), on two stages by attribute
    path, against the same step on one NNX model (the one-device reference of the docs); in NNX's graph
    mode (its default) and its tree mode, whose transforms are JAX's own (`nnx.set_graph_mode(False)`)."""
    with nnx.set_graph_mode(mode == "graph"):
        _in_place_step_through_functional_step(jitted)


def _in_place_step_through_functional_step(jitted):
    a, b = _stages()
    with a, b:
        step_fn, init_fn, batch_fn = parallelize(functional_step(nnx.jit(train_step) if jitted else train_step),
                                                 init_params=make_objects, get_input_batch=get_batch)
    assert [p.name for p in step_fn.plan.placements] == ["first", "second"]
    _check_plan_directions(step_fn.plan)
    losses, (model, optimizer) = _train(step_fn, init_fn, batch_fn)
    assert isinstance(model, Net) and isinstance(optimizer, nnx.Optimizer)
    assert int(optimizer.step[...]) == STEPS

    with nnx.use_eager_sharding(False):   # the one-device reference: plain NNX, in place
        ref_model, ref_opt = make_objects()
    ref_step = nnx.jit(train_step)
    batch = get_batch()
    ref_losses = [float(ref_step(ref_model, ref_opt, batch)) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _check_placement(_params(model))
    _assert_same_params(_params(model), _params(ref_model))


def test_in_place_step_with_the_layout_chosen_by_the_search():
    """``parallelize(functional_step(train_step), layout="auto")`` on (model, optimizer): the search reads the
    NNX variables' names ("embed", "mlp") as the standard rules' logical names, and the layout it picks trains
    like plain NNX on one device."""
    step_fn, init_fn, batch_fn = parallelize(functional_step(train_step), init_params=make_objects,
                                             get_input_batch=get_batch, layout="auto", profile="h100-sxm",
                                             num_devices=4, axes=("data", "tensor"), rule_sets=("standard",),
                                             progress=False)
    search = step_fn.layout_search
    assert any(c.layout.mesh.get("tensor", 1) > 1 for c in search.fitting)  # "mlp" has a rule: tensor layouts
    losses, (model, _) = _train(step_fn, init_fn, batch_fn)
    with nnx.use_eager_sharding(False):
        ref_model, ref_opt = make_objects()
    ref_step, batch = nnx.jit(train_step), get_batch()
    ref_losses = [float(ref_step(ref_model, ref_opt, batch)) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_same_params(_params(model), _params(ref_model))
    kernel = _params(model)["blocks"][0]["mlp"]["up"]["kernel"][...]
    assert len(kernel.sharding.device_set) == search.best.num_devices


def test_functional_step_split_merge_form():
    """The ``nnx.split`` form: the state is the nnx.State of (model, optimizer), merged and split each step."""
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(make_objects))
    step_fn, init_fn, batch_fn = parallelize(functional_step(train_step, graphdef),
                                             init_params=lambda: nnx.state(make_objects()),
                                             get_input_batch=get_batch, mesh={"data": 4, "model": 2}, rules=RULES)
    losses, state = _train(step_fn, init_fn, batch_fn)
    assert isinstance(state, nnx.State)
    model, optimizer = nnx.merge(graphdef, state)
    up = model.blocks[0].mlp.up.kernel[...]
    assert up.sharding.spec == P(None, "model") and len(up.sharding.device_set) == 8
    ref_losses, ref_state = _reference(functional_step(train_step, graphdef), lambda: nnx.state(make_objects()))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_same_params(state, ref_state)


def test_in_place_step_given_as_it_is_names_the_bridge():
    with pytest.raises(TypeError, match=r"train_step takes 3 arguments.*NNX objects \(Net, Optimizer\).*"
                                        r"functional_step\(train_step\)"):
        parallelize(train_step, init_params=make_objects, get_input_batch=get_batch)


def test_functional_step_names_a_bad_state():
    step_fn = functional_step(train_step)
    with pytest.raises(TypeError, match=r"functional_step\(train_step\).*tuple of NNX objects.*got dict"):
        step_fn({"model": 1}, get_batch())
    with pytest.raises(TypeError, match="functional_step needs the in-place step.*got int"):
        functional_step(3)


# -- the scopes themselves ----------------------------------------------------------------------------


def _plain_net():
    with nnx.use_eager_sharding(False):
        return Net(nnx.Rngs(0))


def test_scope_names_are_whole_attribute_paths_and_nest():
    model = _plain_net()
    with register_task(r"nothing", devices=jax.devices()[:2]), module_scopes():
        jaxpr = jax.make_jaxpr(lambda x: model(x))(jnp.ones((2, 4)))
    stacks = {tuple(scope_names(e.source_info.name_stack)) for e in jaxpr.eqns}
    assert ("embed",) in stacks and ("head",) in stacks
    assert ("blocks.2", "blocks.2.mlp", "blocks.2.mlp.up") in stacks
    assert ("blocks.0", "blocks.0.norm") in stacks


class ScannedNet(nnx.Module):
    """JAX's own transforms over NNX modules: stacks (``nnx.vmap``) run by ``jax.lax.scan`` over the module,
    and a head under ``jax.checkpoint``. Each hands its body a module JAX's unflattening rebuilt. With
    ``twins``, a second stack of the same structure: a scanned copy could be of either."""

    def __init__(self, rngs: nnx.Rngs, twins: bool = False):
        self.embed = nnx.Linear(4, D, rngs=rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.layers = make(rngs)
        self.more_layers = make(rngs) if twins else None
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        for stack in (self.layers, self.more_layers):
            if stack is not None:
                x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), self.embed(x) if stack is self.layers else x,
                                    stack)
        return jax.checkpoint(lambda head, x: head(x))(self.head, x)


def _scan_body_scopes(jaxpr) -> list[set[tuple]]:
    return [{tuple(scope_names(e.source_info.name_stack)) for e in scan.params["jaxpr"].eqns}
            for scan in jaxpr.eqns if scan.primitive.name == "scan"]


def test_copies_jax_transforms_make_keep_their_paths():
    with nnx.use_eager_sharding(False):
        model = ScannedNet(nnx.Rngs(0))
    with register_task(r"nothing", devices=jax.devices()[:2]), module_scopes():
        jaxpr = jax.make_jaxpr(lambda x: model(x))(jnp.ones((2, 4)))
    (body,) = _scan_body_scopes(jaxpr)
    assert body >= {("layers",), ("layers", "layers.mlp", "layers.mlp.up"), ("layers", "layers.norm")}
    assert "head" in names_in(jaxpr)


def test_scanned_copies_of_twin_stacks_are_named_by_the_stack_they_scan():
    """Two stacks of one structure, each run by ``jax.lax.scan``: the parameters each scan reads name it."""
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(ScannedNet(nnx.Rngs(0), twins=True))
    scopes = StepScopes()

    def traced(p, x):
        model = nnx.merge(graphdef, p)
        with scopes(model):
            return model(x)

    with register_task(r"nothing", devices=jax.devices()[:2]):
        args = (params, jnp.ones((2, 4)))
        jaxpr = scopes.named(jax.make_jaxpr(traced)(*args), args, "test").jaxpr
    first, second = _scan_body_scopes(jaxpr)
    assert ("layers", "layers.mlp", "layers.mlp.up") in first and ("more_layers", "more_layers.norm") in second
    assert {n.split(".")[0] for names in first for n in names} == {"layers"}
    assert {n.split(".")[0] for names in second for n in names} == {"more_layers"}


class CheckpointedNet(Net):
    """``Net`` with each block run under ``jax.checkpoint``."""

    def __call__(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = jax.checkpoint(lambda b, h: b(h))(block, h)
        return self.head(h)


def test_copies_of_twins_are_named_by_the_parameters_they_read():
    """Blocks of one structure, each under ``jax.checkpoint``: each copy could be of any block until the
    parameters its equations read say which (the step's inputs, by their paths in its arguments). A model
    the step closes over (its parameters constants, read by no input) leaves them unnamed, and says so."""
    with nnx.use_eager_sharding(False):
        model = CheckpointedNet(nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    blocks = {f"blocks.{i}{sub}" for i in range(BLOCKS) for sub in ("", ".norm", ".mlp", ".mlp.up", ".mlp.down")}

    def names(step, *args):
        scopes = StepScopes()

        def traced(*args):
            with scopes(args):
                return step(*args)

        return names_in(scopes.named(jax.make_jaxpr(traced)(*args), args, "test").jaxpr)

    with register_task(r"blocks\.1", devices=jax.devices()[:2]):
        assert names(lambda p, x: nnx.merge(graphdef, p)(x), params, jnp.ones((2, 4))) == {"embed", "head", *blocks}
        with pytest.warns(UserWarning) as record:
            assert names(lambda x: model(x), jnp.ones((2, 4))) == {"embed", "head"}
    (warning,) = [str(w.message) for w in record if "twin" in str(w.message)]  # once, for the four copies
    assert ("test: a module copy that a JAX transform made" in warning
            and "twin of several of the model's modules (blocks.0, blocks.1, blocks.2, blocks.3)" in warning
            and "reads none of their parameters" in warning and "patterns ['blocks\\\\.1']" in warning), warning


def test_classes_are_restored_even_on_error_and_other_threads_see_no_scopes():
    original, model = Block.__call__, _plain_net()
    seen: list = []

    def elsewhere():  # another thread, while the block below is active: no scopes
        seen.append(jax.make_jaxpr(lambda x: model(x))(jnp.ones((2, 4))))

    with pytest.raises(RuntimeError, match="boom"):
        with module_scopes():
            assert Block.__call__ is not original
            thread = threading.Thread(target=elsewhere)
            thread.start()
            thread.join()
            raise RuntimeError("boom")
    assert Block.__call__ is original and nnx.Linear.__call__.__name__ == "__call__"
    assert not hasattr(nnx.Linear.__call__, "__wrapped__")
    assert all(str(e.source_info.name_stack) == "" for e in seen[0].eqns)


@pytest.mark.filterwarnings("ignore:parallelize. no rules=")
def test_no_registration_no_scopes_and_a_typo_is_named():
    """Without registrations NNX steps trace as before; a pattern that matches no path warns with the paths."""
    plain, _, _ = parallelize(step, init_params=init, get_input_batch=get_batch, mesh={"data": 8})
    assert {n for n in names_in(plain.plan.jaxpr) if n} == set()  # ("": a jvp of no scope)
    with pytest.warns(UserWarning, match=r"'block\\\\\.0'.*blocks\.0"):
        with register_task(r"block\.0", devices=jax.devices()[:4]):
            parallelize(step, init_params=init, get_input_batch=get_batch, mesh={"data": 8})
    with register_task(r"block\.0", devices=jax.devices()[:4]):
        with pytest.raises(ValueError, match=r"match no Flax module.*blocks\.0\.mlp"):
            parallelize(step, init_params=init, get_input_batch=get_batch, mesh={"data": 8}, strict=True)


# -- parallelize_step: strict= and NNX factories ---------------------------------------------------------


class Loss(nnx.Module):
    """An NNX model whose call is the loss (parallelize_step's contract)."""

    def __init__(self, rngs: nnx.Rngs):
        self.net = Net(rngs)

    def __call__(self, batch):
        return jnp.mean((self.net(batch["x"]) - batch["y"]) ** 2)


class KeywordRngs(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.net = Net(rngs)

    def __call__(self, batch):
        return jnp.mean((self.net(batch["x"]) - batch["y"]) ** 2)


def _mesh():
    return build_mesh({"data": 4, "tensor": 2})


def test_parallelize_step_nnx_factories_match_one_device():
    """A positional factory and a class taking ``rngs=`` give the same 3 steps as one device."""
    batch = get_batch()
    results = []
    for model in (Loss, KeywordRngs):
        step_fn, state, _ = parallelize_step(model, TX, _mesh(), global_batch=batch, replicate_inputs=False)
        losses = []
        for _ in range(STEPS):
            loss, state = step_fn(state, batch)
            losses.append(float(loss))
        results.append(losses)
    ref = _nnx_reference(batch)
    np.testing.assert_allclose(results[0], ref, rtol=1e-5)
    np.testing.assert_allclose(results[1], ref, rtol=1e-5)


def _nnx_reference(batch):
    """parallelize_step's losses on one device: the Loss module of seed 42, trained in place."""
    with nnx.use_eager_sharding(False):
        model = Loss(nnx.Rngs(42))  # parallelize_step's seed
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def one_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: m(batch))(model)
        optimizer.update(model, grads)
        return loss

    return [float(one_step(model, optimizer, batch)) for _ in range(STEPS)]


def test_parallelize_step_places_nnx_submodules_by_path():
    """parallelize_step's NNX path with stages registered by attribute path (from the loss module: ``net.*``)."""
    devices, batch = jax.devices(), get_batch()
    rules = [("batch", "data"), ("mlp", "model"), ("embed", None)]
    first = build_mesh({"data": 2, "model": 2}, devices[:4])
    second = build_mesh({"data": 2, "model": 2}, devices[4:])
    with register_task(r"net\.(embed|blocks\.[01])", name="first", mesh=first, logical_axes=rules), \
            register_task(r"net\.(blocks\.[23]|head)", name="second", mesh=second, logical_axes=rules):
        step_fn, state, _ = parallelize_step(Loss, TX, _mesh(), global_batch=batch, strict=True)
    assert [p.name for p in step_fn.plan.placements] == ["first", "second"]
    losses = []
    for _ in range(STEPS):
        loss, state = step_fn(state, batch)
        losses.append(float(loss))
    _check_placement(state.params["net"])
    np.testing.assert_allclose(losses, _nnx_reference(batch), rtol=1e-5)


def test_parallelize_step_strict():
    """strict=True reaches parallelize: a logical name without a rule is an error, not a replication."""
    batch = get_batch()
    rules = [("batch", "data")]  # no rule for "mlp" / "embed"
    parallelize_step(Loss, TX, _mesh(), global_batch=batch, rules=rules)
    with pytest.raises(ValueError, match="mlp|embed"):
        parallelize_step(Loss, TX, _mesh(), global_batch=batch, rules=rules, strict=True)


def _returns_none(rngs):
    Loss(rngs)


def _returns_state(rngs):
    return nnx.state(Loss(rngs))


def _needs_config(config, rngs):
    return Loss(rngs)


@pytest.mark.parametrize("factory, names", [
    (_returns_none, ["_returns_none", "returned None", "missing return"]),
    (_returns_state, ["_returns_state", "returned a State", "not an nnx.Module"]),
    (_needs_config, ["_needs_config", "(config, rngs)", "one argument", "lambda rngs"]),
    (lambda: Loss(nnx.Rngs(0)), ["<lambda>", "()", "one argument, the nnx.Rngs"]),
    (3, ["model must be", "got int"]),
])
def test_bad_nnx_factories_are_type_errors(factory, names):
    with pytest.raises(TypeError) as info:
        parallelize_step(factory, TX, _mesh(), global_batch=get_batch())
    for name in names:
        assert name in str(info.value), (name, str(info.value))
