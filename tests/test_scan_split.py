"""One scanned layer stack (``nn.scan``) split over pipeline stages: ``register_task(..., split=...)``.

Every check compares with the same step on one device (`ignore_transforms`), and reads where the
stacked arrays really live from their shards.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from multimesh.checkpoint import CheckpointManager
from multimesh.jax import clear_tasks, ignore_transforms, microbatch, mjit, parallelize, register_task

pytestmark = pytest.mark.devices(8)

WIDTH, HIDDEN, LAYERS, BATCH = 8, 16, 4, 16
RULES = [("batch", "data"), ("mlp", "model")]


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        w = self.param("w", nn.with_logical_partitioning(nn.initializers.normal(0.3), ("embed", "mlp")),
                       (WIDTH, HIDDEN))
        v = self.param("v", nn.with_logical_partitioning(nn.initializers.normal(0.3), ("mlp", "embed")),
                       (HIDDEN, WIDTH))
        return x + jnp.tanh(x @ w) @ v, None


class Net(nn.Module):
    scan_axis: int = 0  # MaxText's param_scan_axis
    remat: bool = False  # each layer rematerialised in the backward (nn.remat inside the scan)

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(WIDTH, name="embed")(x)
        layer = nn.remat(Layer) if self.remat else Layer
        stack = nn.scan(layer, variable_axes={"params": self.scan_axis}, split_rngs={"params": True},
                        length=LAYERS, metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(WIDTH, name="head")(x)


TX = optax.adam(1e-2)


def make_step(model: Net, microbatches: int | None = 4, schedule: str = "1f1b"):
    def loss(p, b):
        return jnp.sum((model.apply(p, b["x"]) - b["y"]) ** 2) / (BATCH * WIDTH)

    def step(state, batch):
        f = loss if microbatches is None else microbatch(loss, 0, BATCH // microbatches, argnum=1,
                                                         schedule=schedule)
        value, grads = jax.value_and_grad(f)(state["params"], batch)
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    return step


def init_for(model: Net):
    def init():
        params = model.init(jax.random.key(0), jnp.zeros((2, WIDTH)))
        return {"params": params, "opt": TX.init(params)}

    return init


def get_batch():
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    return {"x": x, "y": jnp.roll(x, 1, axis=-1)}


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    clear_tasks()


def register_stages(stages: int, dims: tuple[int, ...], axes: tuple[str, ...], rules=RULES):
    """embed on the first stage, head on the last, the scanned layers split evenly over all of them."""
    per, size = LAYERS // stages, int(np.prod(dims))
    where = [((s * size, (s + 1) * size), f"stage{s}") for s in range(stages)]
    kw = dict(dims=dims, device_axes=axes, logical_axes=rules)
    register_task(r"embed", callback=lambda m, b: where[0], **kw)
    register_task(r"head", callback=lambda m, b: where[-1], **kw)
    return register_task(r"layers", split={(s * per, (s + 1) * per): where[s] for s in range(stages)}, **kw)


def stacked(tree) -> dict[str, jax.Array]:
    """The stacked arrays (parameters and Adam moments of the scanned layers), by path."""
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(tree))[0]
    return {jax.tree_util.keystr(p): x for p, x in flat if "'layers'" in jax.tree_util.keystr(p)}


def reference(model: Net, steps: int, microbatches: int | None = 4):
    step = make_step(model, microbatches)

    def one(state, batch):
        with ignore_transforms():
            return step(state, batch)

    fn = jax.jit(one)
    state, batch = jax.device_put((init_for(model)(), get_batch()), jax.devices()[0])
    losses = []
    for _ in range(steps):
        loss, state = fn(state, batch)
        losses.append(float(loss))
    return losses, state


def check_on_stages(x: jax.Array, axis: int, stages: int, size: int) -> None:
    """Layers [s*L/S, (s+1)*L/S) of ``x`` have their shards on stage s's devices only."""
    per = LAYERS // stages
    for shard in x.addressable_shards:
        first = shard.index[axis].start or 0
        stop = shard.index[axis].stop or LAYERS
        s = first // per
        assert stop <= (s + 1) * per, f"a shard spans two stages: {shard.index}"
        assert s * size <= shard.device.id < (s + 1) * size, (
            f"layers [{first}, {stop}) on device {shard.device.id}, not on stage {s}")


@pytest.mark.filterwarnings("error:split scan stack")  # nothing is gathered whole
@pytest.mark.parametrize("scan_axis, schedule, remat", [(0, "1f1b", False), (1, "1f1b", False), (0, "zb-h1", True)])
def test_split_stack_matches_one_device_and_lives_on_its_stages(scan_axis, schedule, remat):
    """2+2 layers over 2 stages of 4 devices, 4 microbatches: 3 Adam steps equal one device."""
    model = Net(scan_axis, remat)
    register_stages(2, (2, 2), ("data", "model"))
    step_fn, init_fn, batch_fn = parallelize(make_step(model, schedule=schedule), init_params=init_for(model),
                                             get_input_batch=get_batch, donate=True)
    state, batch = init_fn(), batch_fn()
    assert len(stacked(state)) == 6  # w and v: parameters and both Adam moments
    for x in stacked(state).values():
        check_on_stages(x, scan_axis, 2, 4)

    plan = step_fn.plan
    assert any(seg.label.startswith("stage1:") for seg in plan.segments)
    whole = {tuple(x.shape) for x in stacked(state).values()}
    parts = {tuple(LAYERS // 2 if d == scan_axis else n for d, n in enumerate(shape)) for shape in whole}
    moved = {tuple(aval.shape) for *_, aval, _ in plan.transfers()}
    assert not moved & (whole | parts), f"the stack (or a part) moves between stages: {moved}"

    ref_losses, ref_state = reference(model, 3)
    for i in range(3):
        loss, state = step_fn(state, batch)
        np.testing.assert_allclose(float(loss), ref_losses[i], rtol=1e-5)
    assert step_fn.stats.peak_live_activations == {0: 2, 1: 1}
    for (path, got), want in zip(stacked(state).items(), stacked(ref_state).values()):
        check_on_stages(got, scan_axis, 2, 4)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=path)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


class NnxLayer(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.normal(0.3)
        self.w = nnx.Param(init(rngs.params(), (WIDTH, HIDDEN)), out_sharding=("embed", "mlp"))
        self.v = nnx.Param(init(rngs.params(), (HIDDEN, WIDTH)), out_sharding=("mlp", "embed"))

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w[...]) @ self.v[...]


class NnxNet(nnx.Module):
    """The same net in NNX: layers made by ``nnx.vmap``, run by ``nnx.scan`` or by ``jax.lax.scan`` over the
    module (Flax's gspmd guide), its body rematerialised or not; no scope of its own (multimesh names the
    scan's body ``layers`` by the stacked module's attribute path: through NNX's record of its copy, or the
    one module the copy JAX's unflattening made is a slice of)."""

    def __init__(self, rngs, runner: str = "nnx.scan"):
        self.runner = runner
        self.embed = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make(rngs):
            return NnxLayer(rngs)

        self.layers = make(rngs)
        self.head = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        if self.runner.startswith("jax.lax.scan"):
            body = lambda x, layer: (layer(x), None)  # noqa: E731
            if self.runner.endswith("jax.checkpoint"):
                body = jax.checkpoint(body)
            x, _ = jax.lax.scan(body, self.embed(x), self.layers)
            return self.head(x)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: None})
        def run(x, layer):
            return nnx.remat(lambda layer, x: layer(x))(layer, x) if self.runner.endswith("nnx.remat") else layer(x)

        return self.head(run(self.embed(x), self.layers))


@pytest.mark.parametrize("runner", ["nnx.scan", "nnx.scan of nnx.remat", "jax.lax.scan",
                                    "jax.lax.scan of jax.checkpoint"])
def test_nnx_scan_splits_alike(runner):
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: NnxNet(nnx.Rngs(0), runner)), nnx.Param)

    def init():
        params = nnx.state(NnxNet(nnx.Rngs(0), runner), nnx.Param)
        return {"params": params, "opt": TX.init(params)}

    def step(state, batch):
        def loss(p, b):
            return jnp.sum((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2) / (BATCH * WIDTH)

        value, grads = jax.value_and_grad(microbatch(loss, 0, 4, argnum=1))(state["params"], batch)
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    register_stages(2, (2, 2), ("data", "model"))
    step_fn, init_fn, batch_fn = parallelize(step, init_params=init, get_input_batch=get_batch)
    state, batch = init_fn(), batch_fn()

    def one(s, b):
        with ignore_transforms():
            return step(s, b)

    with nnx.use_eager_sharding(False):
        ref_state = jax.device_put(init(), jax.devices()[0])
    ref_batch = jax.device_put(get_batch(), jax.devices()[0])
    for _ in range(2):
        loss, state = step_fn(state, batch)
        ref_loss, ref_state = jax.jit(one)(ref_state, ref_batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert len(stacked(state)) == 6  # w and v: parameters and both Adam moments
    for x in stacked(state).values():
        check_on_stages(x, 0, 2, 4)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


class RematScanNet(nn.Module):
    """Layers stacked by ``nn.remat_scan`` (a scan of scans, each layer rematerialised): ``(2, 2, ...)``."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(WIDTH, name="embed")(x)
        x = nn.remat_scan(RematScanLayer, lengths=(2, 2))(name="layers")(x)
        return nn.Dense(WIDTH, name="head")(x)


class RematScanLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(WIDTH)(jnp.tanh(x))


def test_remat_scan_splits_by_its_outer_scan():
    """``nn.remat_scan``'s outer scan split in two: the first two layers on devices 0-3, the last two on 4-7."""
    model, tx = RematScanNet(), optax.sgd(0.1)

    def init():
        params = model.init(jax.random.key(0), jnp.ones((BATCH, WIDTH)))["params"]
        return {"params": params, "opt": tx.init(params)}

    def step(state, batch):
        def loss(p):
            return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    with register_task(r"layers", split={(0, 1): ((0, 4), "a"), (1, 2): ((4, 8), "b")}, dims=(4,),
                       device_axes=("data",)):
        step_fn, init_fn, batch_fn = parallelize(step, init_params=init, get_input_batch=get_batch)
    assert [p.name for p in step_fn.plan.placements] == ["a", "b"]
    state, batch = init_fn(), batch_fn()
    ref_state, ref_batch = jax.device_put((init(), get_batch()), jax.devices()[0])
    for _ in range(3):
        loss, state = step_fn(state, batch)
        ref_loss, ref_state = jax.jit(step)(ref_state, ref_batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    kernel = state["params"]["layers"]["Dense_0"]["kernel"]
    assert kernel.shape == (2, 2, WIDTH, WIDTH)
    for shard in kernel.addressable_shards:  # outer index s on stage s's devices only
        assert shard.data.shape[0] == 1 and shard.device.id // 4 == shard.index[0].start
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_split_without_microbatches_and_over_four_stages():
    """No pipeline schedule: the split alone places the parts; 1+1+1+1 over 4 stages of 2 devices."""
    model = Net()
    register_stages(4, (2,), ("data",), rules=[("batch", "data")])
    step_fn, init_fn, batch_fn = parallelize(make_step(model, microbatches=None), init_params=init_for(model),
                                             get_input_batch=get_batch)
    state, batch = init_fn(), batch_fn()
    ref_losses, ref_state = reference(model, 2, microbatches=None)
    for i in range(2):
        loss, state = step_fn(state, batch)
        np.testing.assert_allclose(float(loss), ref_losses[i], rtol=1e-5)
    for got, want in zip(stacked(state).values(), stacked(ref_state).values()):
        check_on_stages(got, 0, 4, 2)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_mjit_splits_the_stack_of_arguments_it_takes_as_they_are():
    """`mjit` takes the state on one device; the stacked arrays come back split over the stages, and a second
    call takes them as they came."""
    model = Net()
    register_stages(2, (2, 2), ("data", "model"))
    fn = mjit(make_step(model), donate_argnums=0)
    state, batch = jax.device_put((init_for(model)(), get_batch()), jax.devices()[0])
    ref_losses, ref_state = reference(model, 2)
    for i in range(2):
        loss, state = fn(state, batch)
        np.testing.assert_allclose(float(loss), ref_losses[i], rtol=1e-5)
    assert "split scan stack: layers[0:2] on stage0, layers[2:4] on stage1" in str(fn.plan)
    assert len(stacked(state)) == 6
    for got, want in zip(stacked(state).values(), stacked(ref_state).values()):
        check_on_stages(got, 0, 2, 4)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_checkpoint_of_a_split_stack_restores_onto_another_split_and_onto_spmd(tmp_path):
    model = Net()
    with register_stages(2, (2, 2), ("data", "model")):
        step_fn, init_fn, batch_fn = parallelize(make_step(model), init_params=init_for(model),
                                                 get_input_batch=get_batch)
        state, batch = init_fn(), batch_fn()
        _, state = step_fn(state, batch)
    clear_tasks()
    saved = jax.device_get(state)
    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        mgr.save(1, state)
    _, after = reference(model, 2)  # where the run goes next

    register_stages(4, (2,), ("data",), rules=[("batch", "data")])
    split4, _, batch4 = parallelize(make_step(model), init_params=init_for(model), get_input_batch=get_batch)
    clear_tasks()
    spmd, _, batch_spmd = parallelize(make_step(model, microbatches=None), init_params=init_for(model),
                                      get_input_batch=get_batch, mesh={"data": 4, "model": 2}, rules=RULES)
    for fn, make_batch, stages in ((split4, batch4, 4), (spmd, batch_spmd, None)):
        with CheckpointManager(str(tmp_path / "ckpt"), read_only=True) as mgr:
            restored = mgr.restore(1, target=fn).state
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
            assert np.array_equal(np.asarray(got), want)  # bit for bit
        if stages is not None:
            for x in stacked(restored).values():
                check_on_stages(x, 0, 4, 2)
        _, resumed = fn(restored, make_batch())
        for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(after)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_bad_splits_are_clear_errors():
    model = Net()
    kw = dict(dims=(4,), device_axes=("data",))
    with pytest.raises(ValueError, match=r"increasing order"):
        register_task(r"layers", split={(2, 4): ((4, 8), "b"), (0, 2): ((0, 4), "a")}, **kw)
    with pytest.raises(TypeError, match=r"split= maps layer ranges"):
        register_task(r"layers", split=[(0, 2), (2, 4)], **kw)
    with pytest.raises(ValueError, match=r"without task=, callback="):
        register_task(r"layers", split={(0, 2): ((0, 4), "a"), (2, 4): ((4, 8), "b")},
                      callback=lambda m, b: None, **kw)
    with pytest.raises(ValueError, match=r"at least two"):
        register_task(r"layers", split={(0, 4): ((0, 4), "a")}, **kw)

    def build():
        return parallelize(make_step(model, microbatches=None), init_params=init_for(model),
                           get_input_batch=get_batch)

    with register_task(r"layers", split={(0, 2): ((0, 4), "a"), (2, 3): ((4, 8), "b")}, **kw):
        with pytest.raises(ValueError, match=r"runs 4 layers.*\(0, 2\), \(2, 3\)"):
            build()
    with register_task(r"layers", split={(0, 2): "stage0", (2, 4): "stage1"}, **kw):
        with pytest.raises(ValueError, match=r"split= values must be a Task, .* got 'stage0' for 'layers'"):
            build()
    with register_task(r"layers", split={(0, 3): ((0, 4), "a"), (3, 4): ((4, 8), "b")}, **kw):
        with pytest.raises(NotImplementedError, match=r"unequal lengths \[3, 1\]"):
            build()
    with register_task(r"layers", split={(0, 2): ((0, 4), "a"), (2, 4): ((0, 4), "b")}, **kw):
        with pytest.raises(NotImplementedError, match=r"share devices"):
            build()


# -- the trainer: model.scan_layers ------------------------------------------------------------

SMALL = ["model.d_model=32", "model.max_len=32", "data.seq_len=32", "data.batch_size=8", "data.max_bytes=200000",
         "train.eval_batches=2", "train.eval_every=1000", "train.log_every=1", "model.scan_layers=true"]


def _losses(result, first: int, last: int) -> list[float]:
    return [result.losses[s] for s in range(first, last + 1)]


def _pipeline_and_one_device(tmp_path, *over: str):
    from trainers.config import load_config

    pipe = load_config("pipeline", [*SMALL, *over, f"train.out_dir={tmp_path / 'run'}"])
    one = pipe.replace(name="one", layout={"mesh": {"data": 1}, "pipeline": None},
                       train={"out_dir": str(tmp_path / "one")})
    return pipe, one


def _stacked_kernel(params) -> jax.Array:
    """The scanned stack's ``mlp/wo/kernel`` from the trainer's Linen variables or NNX state."""
    if isinstance(params, nnx.State):
        return params["layers"]["mlp"]["wo"]["kernel"][...]
    return nn.unbox(params)["params"]["layers"]["mlp"]["wo"]["kernel"]


@pytest.mark.filterwarnings("error:split scan stack")  # nothing is gathered whole
@pytest.mark.slow  # half a minute per api; the split stack's own tests stay in the default suite
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_trainer_pipeline_splits_the_scanned_stack(tmp_path, api):
    """``model.scan_layers`` on the 2-stage pipeline: the stack lives split, the losses follow one device.
    The NNX model (``nnx.vmap`` + ``nnx.scan``, no scope of its own) is split by the same registration."""
    from trainers.train import train

    pipe, one = _pipeline_and_one_device(tmp_path, "train.steps=3", f"model.api={api}")
    got, want = train(pipe, quiet=True), train(one, quiet=True)
    np.testing.assert_allclose(_losses(got, 1, 3), _losses(want, 1, 3), rtol=1e-4)
    kernel = _stacked_kernel(got.state["params"])
    assert kernel.shape[0] == 4 and kernel.sharding.spec[0] == "stage"
    check_on_stages(kernel, 0, 2, 4)


@pytest.mark.slow  # ~2 min: three pipeline programs
def test_trainer_scanned_checkpoint_resumes_on_four_stages_and_one_device(tmp_path):
    """Saved from the 2-stage split, resumed on the 4-stage split (another split) and on one device."""
    import shutil

    from trainers.config import load_config
    from trainers.train import train

    over = ("train.steps=4", "train.checkpoint_every=2")
    pipe, one = _pipeline_and_one_device(tmp_path, *over)
    train(pipe, quiet=True, stop_after=3)
    want = train(one, quiet=True)
    shutil.copytree(tmp_path / "run", tmp_path / "single")
    on_four = train(load_config("pipeline4", [*SMALL, *over, f"train.out_dir={tmp_path / 'run'}"]), quiet=True)
    on_one = train(one.replace(train={"out_dir": str(tmp_path / "single")}), quiet=True)
    assert on_four.start_step == on_one.start_step == 2
    np.testing.assert_allclose(_losses(on_four, 3, 4), _losses(want, 3, 4), rtol=1e-4)
    np.testing.assert_allclose(_losses(on_one, 3, 4), _losses(want, 3, 4), rtol=1e-4)
    check_on_stages(nn.unbox(on_four.state["params"])["params"]["layers"]["mlp"]["wo"]["kernel"], 0, 4, 2)


def test_trainer_config_refuses_what_the_split_cannot_do():
    from trainers.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"does not divide model.num_layers=3"):
        load_config("pipeline", ["model.scan_layers=true", "model.num_layers=3"])


def test_a_split_must_name_a_scan_the_step_runs():
    model = Net()
    kw = dict(dims=(4,), device_axes=("data",))
    halves = {(0, 2): ((0, 4), "a"), (2, 4): ((4, 8), "b")}
    with register_task(r"embed", split=halves, **kw):
        with pytest.raises(ValueError, match=r"matches \['embed'\], which runs no scan"):
            parallelize(make_step(model, microbatches=None), init_params=init_for(model), get_input_batch=get_batch)

    def rematted_step(state, batch):  # the whole model under one jax.checkpoint: its scan is inside it
        loss = jax.checkpoint(lambda p: jnp.sum((model.apply(p, batch["x"]) - batch["y"]) ** 2))
        value, grads = jax.value_and_grad(loss)(state["params"])
        return value, grads

    with register_task(r"layers", split=halves, **kw):
        with pytest.raises(NotImplementedError, match=r"registered with split= runs inside"):
            parallelize(rematted_step, init_params=init_for(model), get_input_batch=get_batch)


def test_a_stack_no_registration_places_is_named_in_a_warning():
    """A per-layer pattern matches nothing inside a scan: the stack would run whole on one stage, silently."""
    model = Net()
    kw = dict(dims=(4,), device_axes=("data",))
    register_task(r"embed", devices=jax.devices()[:4], **{k: v for k, v in kw.items() if k != "dims"})
    register_task(r"head|layers_(\d+)", callback=lambda m, b: ((4, 8), "stage1"), **kw)
    with pytest.warns(UserWarning, match=r"scanned stack 'layers' \(4 layers in one scan\) matches no registration"):
        parallelize(make_step(model, microbatches=None), init_params=init_for(model), get_input_batch=get_batch)


@pytest.mark.slow  # a quarter of a minute: with -m slow, for the default suite's 15 minutes
def test_trainer_spmd_layout_runs_the_scanned_stack(tmp_path):
    """``model.scan_layers`` on an SPMD layout (tensor parallel): the stack runs whole, as on one device."""
    from trainers.config import load_config
    from trainers.train import train

    cfg = load_config("tp", [*SMALL, "model.num_layers=2", "train.steps=2", f"train.out_dir={tmp_path / 'tp'}"])
    one = cfg.replace(name="one", layout={"mesh": {"data": 1}}, train={"out_dir": str(tmp_path / "one")})
    got, want = train(cfg, quiet=True), train(one, quiet=True)
    np.testing.assert_allclose(_losses(got, 1, 2), _losses(want, 1, 2), rtol=1e-4)
    kernel = nn.unbox(got.state["params"])["params"]["layers"]["mlp"]["wo"]["kernel"]
    assert kernel.shape[0] == 2 and kernel.sharding.spec[0] is None and "tensor" in tuple(kernel.sharding.spec)


def test_a_use_that_needs_the_whole_stack_gathers_it_with_a_warning_and_stays_correct():
    """A cumulative sum over the layer axis cannot run part by part: the parts are put together there."""
    model = Net()

    def step(state, batch):
        def loss(p):
            w = nn.unbox(p)["params"]["layers"]["w"]
            penalty = 1e-3 * jnp.sum(jnp.cumsum(w, axis=0) ** 2)
            return jnp.sum((model.apply(p, batch["x"]) - batch["y"]) ** 2) / (BATCH * WIDTH) + penalty

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    register_stages(2, (2, 2), ("data", "model"))
    with pytest.warns(UserWarning, match=r"split scan stack .layers.: \d+ equations read its layers whole \(.*cumsum"):
        step_fn, init_fn, batch_fn = parallelize(step, init_params=init_for(model), get_input_batch=get_batch)
    clear_tasks()
    state, batch = init_fn(), batch_fn()

    def one(s, b):
        with ignore_transforms():
            return step(s, b)

    ref_state, ref_batch = jax.device_put((init_for(model)(), get_batch()), jax.devices()[0])
    for _ in range(2):
        loss, state = step_fn(state, batch)
        ref_loss, ref_state = jax.jit(one)(ref_state, ref_batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    for x in stacked(state).values():
        check_on_stages(x, 0, 2, 4)


@pytest.mark.slow  # about 8 s: two processes
def test_split_stack_across_two_processes():
    """Stage s on process s: each process holds its own layers' shards only, and both see the one-device
    losses (jax.distributed on localhost, 4 CPU devices per process)."""
    from pathlib import Path

    from helpers import free_port, run_workers

    worker = str(Path(__file__).with_name("mp_scan_worker.py"))
    port = free_port()
    reports = run_workers([[worker, str(i), str(port)] for i in range(2)], timeout=300)
    assert reports[0]["losses"] == reports[1]["losses"]
    assert [r["layers"] for r in reports] == [[0, 1], [2, 3]]
    assert all(r["shards_checked"] > 0 for r in reports)


def test_parts_are_views_of_the_stacked_array_both_ways():
    """What a stage's program reads is the stacked array's own buffers on that stage, and what it writes
    becomes the stacked output without a copy (run.stacked)."""
    from multimesh.run.stacked import from_parts, to_parts

    model = Net()
    register_stages(2, (2, 2), ("data", "model"))
    step_fn, init_fn, _ = parallelize(make_step(model), init_params=init_for(model), get_input_batch=get_batch)
    state = init_fn()
    flat = jax.tree.leaves(state)
    boundary = step_fn.plan.boundary
    split = [i for i, how in enumerate(boundary.inputs[:len(flat)]) if how is not None]
    assert len(split) == 6
    for i in split:
        x, how = flat[i], boundary.inputs[i]
        parts = to_parts([x], [how], [x.sharding])
        assert [p.sharding.device_set for p in parts] == [pl.devices for pl in how.split.placements]

        def pointers(arrays):
            return sorted(s.data.unsafe_buffer_pointer() for a in arrays for s in a.addressable_shards)

        assert pointers(parts) == pointers([x])
        (back,) = from_parts(parts, [how], [x.sharding])
        assert back.sharding == x.sharding and pointers([back]) == pointers([x])
        np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
