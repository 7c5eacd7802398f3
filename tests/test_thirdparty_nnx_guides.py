"""Flax NNX's own guides, their code run as it is, trained through multimesh against one device.

Vendored unmodified from google/flax under ``tests/thirdparty/flax_nnx_guides/`` (MyST pages; the test
runs some of their code cells, each page in a namespace of its own):

* ``flax_gspmd.md``, "Scale up on multiple devices": the page NNX users shard from. Its ``MultiDotReluDot``
  names mesh axes in ``nnx.with_partitioning`` and ``nnx.Param(sharding=...)``, stacks its layers with
  ``nnx.vmap`` and runs them with ``jax.lax.scan``, and puts an activation in place with
  ``jax.lax.with_sharding_constraint(y, P('data', 'model'))``: a bare spec, which JAX resolves on the mesh in
  context (``jax.set_mesh``), so under plain ``jax.jit`` with no mesh set the step fails. Its
  ``LogicalMultiDotReluDot`` uses logical names with the page's ``sharding_rules``; its
  ``ExplicitMultiDotReluDot`` JAX's explicit sharding (``out_sharding=`` in initializers and ``jnp.dot``).
* ``mnist_tutorial.md``, "MNIST tutorial": the page NNX users start from. A CNN with ``nnx.BatchNorm`` and
  ``nnx.Dropout`` (its random keys from an ``nnx.Rngs`` the step is given), ``nnx.Optimizer(adamw)``, an
  ``nnx.MultiMetric``, and a ``train_step`` decorated with ``@nnx.jit`` that updates the model (its train
  view, ``nnx.view``), the optimizer, the metrics and the ``Rngs`` in place.

* ``minigpt.md``, "Train a miniGPT language model with JAX": the JAX AI stack's tutorial. A transformer in
  JAX's explicit-sharding style (parameters with ``out_sharding`` metadata, an embedding looked up with
  ``out_sharding=jax.typeof(x).sharding``, logits ``reshard`` to the tokens' sharding) on a mesh of
  Explicit axes named ``batch`` and ``model``, ``nnx.Dropout`` layers that hold their own ``Rngs``, and an
  ``@nnx.jit(donate_argnums=...)`` step updating the model, the optimizer and an ``nnx.MultiMetric``.

* ``06_scan_over_layers.py``, Flax's NNX toy example of a layer stack: ``ScanMLP``, blocks of ``nnx.Linear``,
  ``nnx.BatchNorm`` and ``nnx.Dropout`` (each layer its own random stream) made by ``nnx.vmap`` and run by
  ``nnx.scan``, which updates every layer's batch statistics and random counts.

Adapted only by the test: sizes, the batch (random images and tokens), the mesh of the gspmd page's
"auto-mode" cell made with Auto axes (``jax.make_mesh`` now makes Explicit ones, on which JAX refuses the
page's own ``DotReluDot``), the cells that train or print at the page's sizes cut before their loops, and
the miniGPT page's imports and sizes given by the test (its cells also load a tokenizer and a dataset).
"""

from __future__ import annotations

import contextlib
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import guide_cells
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from vendored import import_or_skip

from multimesh.checkpoint import CheckpointManager
from multimesh.jax import build_mesh, parallelize, register_task
from multimesh.jax.flax import functional_step

pytestmark = pytest.mark.devices(8)

GUIDES = Path(__file__).resolve().parent / "thirdparty" / "flax_nnx_guides"
GSPMD, MNIST, MINIGPT = GUIDES / "flax_gspmd.md", GUIDES / "mnist_tutorial.md", GUIDES / "minigpt.md"
SCAN_OVER_LAYERS = GUIDES / "06_scan_over_layers.py"
STEPS, DEPTH, BATCH = 3, 64, 8
AUTO = (AxisType.Auto, AxisType.Auto)


def run_cells(page: Path, *markers: str, cut: str | None = None, fence: str = "```{code-cell}",
              namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    """The page's cells that contain one of ``markers``, run in order in a fresh namespace (or the one given);
    a cell holding ``cut`` runs up to that line (the page's own loop at its own sizes is left out)."""
    namespace = {} if namespace is None else namespace
    with contextlib.redirect_stdout(None):  # the cells print and display
        for cell in guide_cells(page, *markers, fence=fence):
            if cut is not None and cut in cell:
                cell = cell[:cell.index(cut)]
            import_or_skip(f"tests/thirdparty/flax_nnx_guides/{page.name}",
                           lambda: exec(compile(cell, str(page), "exec"), namespace), errors=(ImportError,))  # noqa: B023
            if "auto_mesh = jax.make_mesh" in cell:  # the page means an Auto mesh, as it says
                namespace["auto_mesh"] = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
    return namespace


def state_leaves(objects: Any) -> list[np.ndarray]:
    """The arrays of NNX objects, random keys as their data, on the host."""
    leaves = jax.tree.leaves(nnx.state(objects))
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in leaves]


def assert_states_close(got: Any, want: Any, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    got, want = state_leaves(got), state_leaves(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


# ----------------------------------------------------------------- "Scale up on multiple devices"
@pytest.fixture(scope="module")
def gspmd() -> dict[str, Any]:
    return run_cells(GSPMD, "from functools import partial", "auto_mesh = jax.make_mesh", "class DotReluDot",
                     "def train_step", "sharding_rules = ", "explicit_mesh = jax.make_mesh", cut="with jax.set_mesh")


def gspmd_parts(page: dict, cls: str):
    """The page's model class and its ``train_step`` (the function under its ``@jax.jit``, which updates
    the model and optimizer in place and returns ``(model, loss)``), in `parallelize`'s form."""
    def objects():
        model = page[cls](DEPTH, 2, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def batch():
        rngs = nnx.Rngs(1)
        return rngs.normal((BATCH, DEPTH)), rngs.normal((BATCH, DEPTH))

    in_place = page["train_step"].__wrapped__
    step = functional_step(lambda model, optimizer, xy: in_place(model, optimizer, *xy)[1])
    return objects, batch, in_place, step


VARIANTS = {  # the page's model class, its mesh, the rules (the batch over data, as the page places it)
    "MultiDotReluDot": ("auto_mesh", (("batch", "data"),)),
    "LogicalMultiDotReluDot": ("auto_mesh", "sharding_rules"),
    "ExplicitMultiDotReluDot": ("explicit_mesh", (("batch", "data"),)),
}


def gspmd_reference(page: dict, cls: str) -> tuple[list[float], Any]:
    """The page's step under `nnx.jit` on one device, a 1 x 1 mesh of the page's axis names in context
    (of its mesh's axis types), built with eager sharding off."""
    objects, batch, in_place, _ = gspmd_parts(page, cls)
    types = page[VARIANTS[cls][0]].axis_types
    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1], axis_types=types)
    losses = []
    with jax.set_mesh(mesh):
        with nnx.use_eager_sharding(False):
            model, optimizer = objects()
        x, y = (jax.device_put(a, P("data", None)) for a in batch())  # as the page places its batch
        for _ in range(STEPS):
            losses.append(float(nnx.jit(in_place)(model, optimizer, x, y)[1]))
    return losses, (model, optimizer)


def test_the_page_needs_its_mesh_in_context_under_plain_jit(gspmd):
    objects, batch, in_place, _ = gspmd_parts(gspmd, "MultiDotReluDot")
    with nnx.use_eager_sharding(False):
        model, optimizer = objects()
    with pytest.raises(RuntimeError, match="with_sharding_constraint requires a non-empty mesh in context"):
        nnx.jit(in_place)(model, optimizer, *batch())


@pytest.mark.parametrize("cls", list(VARIANTS))
def test_gspmd_page_models_equal_one_device(gspmd, cls):
    mesh_name, rules = VARIANTS[cls]
    objects, batch, _, step = gspmd_parts(gspmd, cls)
    built = parallelize(step, init_params=objects, get_input_batch=batch, mesh=gspmd[mesh_name],
                        rules=gspmd[rules] if isinstance(rules, str) else rules)
    # Explicit axes are in context for every step; Auto ones only for a step whose code needs it
    assert repr(built[0]).endswith(")" if cls.startswith("Explicit") else ", its mesh in context)")
    state, batch_ = built[1](), built[2]()
    losses = []
    for _ in range(STEPS):
        loss, state = built[0](state, batch_)
        losses.append(float(loss))
    ref_losses, ref_state = gspmd_reference(gspmd, cls)
    assert ref_losses[-1] < ref_losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_states_close(state, ref_state)
    # where the page says its parameters go (the layer axis of the stack replicated), and the batch over data
    layers = state[0].layers
    assert layers.dot1.kernel[...].sharding.spec == P(None, None, "model")
    assert layers.w2[...].sharding.is_equivalent_to(jax.NamedSharding(gspmd[mesh_name], P(None, "model")), 3)
    assert layers.dot1.kernel[...].addressable_shards[0].data.shape == (2, DEPTH, DEPTH // 4)
    assert batch_[0].sharding.spec == P("data")


def test_gspmd_page_checkpoint_restores_onto_another_mesh(gspmd, tmp_path):
    """The page's last section saves a sharded NNX state and loads it onto a mesh: here, saved from the
    2 x 4 mesh after 2 steps, restored onto a 4 x 2 one, its third step equals one device's."""
    objects, batch, _, step = gspmd_parts(gspmd, "MultiDotReluDot")
    rules = VARIANTS["MultiDotReluDot"][1]
    source = parallelize(step, init_params=objects, get_input_batch=batch, mesh=gspmd["auto_mesh"], rules=rules)
    other = jax.make_mesh((4, 2), ("data", "model"), axis_types=AUTO)
    target = parallelize(step, init_params=objects, get_input_batch=batch, mesh=other, rules=rules)
    state, batch_ = source[1](), source[2]()
    for _ in range(STEPS - 1):
        _, state = source[0](state, batch_)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(STEPS - 1, state)
    with CheckpointManager(tmp_path / "ckpt", read_only=True) as mgr:
        restored = mgr.restore(STEPS - 1, target=target[0]).state
    kernel = restored[0].layers.dot1.kernel[...]
    assert kernel.sharding.mesh.shape == {"data": 4, "model": 2} and kernel.sharding.spec == P(None, None, "model")
    loss, restored = target[0](restored, target[2]())
    ref_losses, ref_state = gspmd_reference(gspmd, "MultiDotReluDot")
    np.testing.assert_allclose(float(loss), ref_losses[-1], rtol=1e-5)
    assert_states_close(restored, ref_state)


def test_gspmd_page_stack_split_over_two_stages_equals_one_device(gspmd):
    """The page's layer stack (``nnx.vmap`` to build, ``jax.lax.scan`` over the module to run) split by its
    attribute name, layer 0 on devices 0-3 and layer 1 on 4-7, each stage a 2 x 2 mesh of the page's axes:
    the bare ``P('data', 'model')`` constraint inside the scanned layer resolves on each stage's mesh."""
    objects, batch, _, step = gspmd_parts(gspmd, "MultiDotReluDot")
    with register_task(r"layers", split={(0, 1): ((0, 4), "first"), (1, 2): ((4, 8), "second")}, dims=(2, 2),
                       device_axes=("data", "model")):
        built = parallelize(step, init_params=objects, get_input_batch=batch, mesh=gspmd["auto_mesh"],
                            rules=VARIANTS["MultiDotReluDot"][1])
    assert {p.name for p in built[0].plan.placements} == {"first", "second"}
    state, batch_, losses = built[1](), built[2](), []
    for _ in range(STEPS):
        loss, state = built[0](state, batch_)
        losses.append(float(loss))
    ref_losses, ref_state = gspmd_reference(gspmd, "MultiDotReluDot")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_states_close(state, ref_state)
    kernel = state[0].layers.dot1.kernel[...]  # (layer, in, out): each layer's shards on its stage's devices
    assert kernel.sharding.spec == P("stage", None, "model")
    for shard in kernel.addressable_shards:
        assert shard.data.shape == (1, DEPTH, DEPTH // 2)
        assert shard.device.id // 4 == shard.index[0].start


# ----------------------------------------------------------------- "MNIST tutorial"
def mnist_page() -> dict[str, Any]:
    """The tutorial's model, optimizer and metrics, train step and views: a fresh namespace (its objects)."""
    return run_cells(MNIST, "class CNN(nnx.Module)", "optimizer = nnx.Optimizer", "def loss_fn(model: CNN",
                     "train_model = nnx.view")


def mnist_batch() -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(3))
    return {"image": jax.random.uniform(k1, (32, 28, 28, 1)), "label": jax.random.randint(k2, (32,), 0, 10)}


def mnist_objects() -> tuple:
    """What the tutorial's loop hands its step: the train view, the optimizer, the metrics, the Rngs.

    The optimizer is the page's, with SGD and momentum at its learning rate for its AdamW: Adam moves
    every entry by about the learning rate whatever its gradient's size, and conv2's bias, which the
    BatchNorm after it cancels, has a gradient that is zero but for rounding, so any other order of
    summation (the batch split over devices) moves it the other way."""
    page = mnist_page()
    optimizer = nnx.Optimizer(page["model"], optax.sgd(page["learning_rate"], page["momentum"]), wrt=nnx.Param)
    return page["train_model"], optimizer, page["metrics"], nnx.Rngs(0)


def mnist_metrics(objects: tuple) -> dict[str, float]:
    return {k: float(v) for k, v in objects[2].compute().items()}


@pytest.fixture(scope="module")
def mnist_reference() -> tuple[list[dict], tuple]:
    """The tutorial's own step (``@nnx.jit``) on one device, its metrics after each step."""
    page, objects, batch, metrics = mnist_page(), mnist_objects(), mnist_batch(), []
    for _ in range(STEPS):
        page["train_step"](*objects, batch)
        metrics.append(mnist_metrics(objects))
    assert metrics[-1]["loss"] < metrics[0]["loss"]  # it trains
    return metrics, objects


def run_page(built, read: Callable[[tuple], Any]) -> tuple[list, tuple]:
    """``STEPS`` steps of a built page's step: what ``read`` reads off its objects after each (the metrics the
    page's loop computes), and the last objects."""
    state, batch, seen = built[1](), built[2](), []
    for _ in range(STEPS):
        _, state = built[0](state, batch)
        seen.append(read(state))
    return seen, state


def assert_mnist_matches(got, want) -> None:
    for a, b in zip(got[0], want[0]):
        np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-5)
    assert_states_close(got[1][0], want[1][0])  # parameters and batch statistics
    # The momenta of the layers before a BatchNorm hold gradients that its backward computes by subtracting
    # the batch's means: rounding of sums over the batch, which the split batch adds in another order.
    assert_states_close(got[1][1:], want[1][1:], rtol=1e-3, atol=1e-4)  # optimizer, metrics, Rngs counts


def test_mnist_tutorial_data_parallel_equals_one_device(mnist_reference):
    step = functional_step(mnist_page()["train_step"])  # the tutorial's @nnx.jit step, as it is
    built = parallelize(step, init_params=mnist_objects, get_input_batch=mnist_batch, mesh={"data": 8},
                        rules=[("batch", "data")])
    got = run_page(built, mnist_metrics)
    assert_mnist_matches(got, mnist_reference)
    image = built[2]()["image"]
    assert image.sharding.spec == P("data") and image.addressable_shards[0].data.shape[0] == 4
    kernel = got[1][0].conv1.kernel[...]
    assert len(kernel.sharding.device_set) == 8 and kernel.addressable_shards[0].data.shape == kernel.shape


def test_mnist_tutorial_two_stage_pipeline_equals_one_device(mnist_reference):
    """The convolutions on devices 0-3, the dense layers on 4-7, by the CNN's attribute names; the step's
    ``Rngs``, drawn from in both stages, and the metrics, updated after both, move between them."""
    step = functional_step(mnist_page()["train_step"])
    devices = jax.devices()
    with register_task(r"conv1|batch_norm1|conv2|batch_norm2", mesh=build_mesh({"data": 4}, devices[:4])), \
            register_task(r"linear1|linear2", mesh=build_mesh({"data": 4}, devices[4:])):
        built = parallelize(step, init_params=mnist_objects, get_input_batch=mnist_batch, mesh={"data": 8},
                            rules=[("batch", "data")])
    assert len(built[0].plan.placements) == 2
    got = run_page(built, mnist_metrics)
    assert_mnist_matches(got, mnist_reference)
    model = got[1][0]
    assert {d.id for d in model.linear1.kernel[...].sharding.device_set} == {4, 5, 6, 7}
    assert {d.id for d in model.batch_norm1.mean[...].sharding.device_set} == {0, 1, 2, 3}
    # the state's scalars (the metrics' totals and counts, the Rngs, the optimizer's count) together on the
    # last stage: the tutorial's loop combines them after the step (metrics.compute())
    scalars = [x for x in jax.tree.leaves(nnx.state(got[1])) if not np.shape(x)]
    assert scalars and all({d.id for d in x.sharding.device_set} == {4, 5, 6, 7} for x in scalars)


# ----------------------------------------------------------------- "Train a miniGPT language model with JAX"
VOCAB, LENGTH = 64, 16


def minigpt_page() -> dict[str, Any]:
    """The tutorial's model and step cells, with its imports but for the data loading ones (grain, pandas,
    tiktoken) and its sizes made small."""
    namespace: dict[str, Any] = dict(vocab_size=VOCAB, maxlen=LENGTH, embed_dim=32, num_heads=4, feed_forward_dim=32,
                                     top_k=10)
    exec("import jax\nimport jax.numpy as jnp\nimport flax.nnx as nnx\nimport optax\n"
         "from dataclasses import dataclass\nfrom jax.sharding import PartitionSpec as P, reshard\n", namespace)
    return run_cells(MINIGPT, "class TransformerBlock", "class TokenAndPositionEmbedding", "class MiniGPT",
                     "def loss_fn(model, batch)", fence="```python", namespace=namespace)


def minigpt_batch() -> tuple[jax.Array, jax.Array]:
    """Token ids and their targets, the next token (the page's ``prep_target_batch``)."""
    tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH), 0, VOCAB)
    return tokens, jax.numpy.concatenate([tokens[:, 1:], jax.numpy.zeros((BATCH, 1), tokens.dtype)], axis=1)


def minigpt_objects() -> tuple:
    """The page's model (4 blocks), optimizer and metrics; SGD with momentum for the page's Adam: attention's
    key bias moves no softmax (it adds the same to every key's score), so its gradient is rounding, which
    Adam scales up to the learning rate, either way as the batch's sums fell."""
    model = minigpt_page()["create_model"](rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param), nnx.MultiMetric(
        loss=nnx.metrics.Average("loss"))


def minigpt_loss(objects: tuple) -> float:
    return float(objects[2].compute()["loss"])


@pytest.fixture(scope="module")
def minigpt_reference() -> tuple[list[float], tuple]:
    """The page's step on one device: a 1 x 1 mesh of its Explicit axes, the batch placed as the page does."""
    page, losses = minigpt_page(), []
    with jax.set_mesh(jax.make_mesh((1, 1), ("batch", "model"), devices=jax.devices()[:1])):
        objects = minigpt_objects()
        batch = jax.device_put(minigpt_batch(), P("batch", None))
        for _ in range(STEPS):
            page["train_step"](*objects, batch)
            losses.append(minigpt_loss(objects))
    assert losses[-1] < losses[0]
    return losses, objects


MINIGPT_MESH = ((4, 2), ("batch", "model"))  # Explicit axes (jax.make_mesh's default), as the page's mesh


@pytest.mark.slow  # 8 s; the two-stage pipeline of the same model meets one device in the default suite
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_minigpt_tutorial_spmd_equals_one_device(minigpt_reference):
    built = parallelize(functional_step(minigpt_page()["train_step"]), init_params=minigpt_objects,
                        get_input_batch=minigpt_batch, mesh=jax.make_mesh(*MINIGPT_MESH))
    losses, state = run_page(built, minigpt_loss)
    np.testing.assert_allclose(losses, minigpt_reference[0], rtol=1e-5)
    assert_states_close(state, minigpt_reference[1])  # the dropout layers' Rngs included
    kernel = state[0].transformer_blocks.layers[0].mlp.layers[0].kernel[...]
    assert kernel.sharding.spec == P(None, "model") and kernel.sharding.mesh.axis_types[0] == AxisType.Explicit
    assert built[2]()[0].sharding.spec == P("batch")  # the mesh's own axis "batch": no rules needed


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_minigpt_tutorial_two_stage_pipeline_equals_one_device(minigpt_reference):
    """The embedding and blocks 0-1 on devices 0-3, blocks 2-3 and the output layer on 4-7, by attribute path,
    each stage a 2 x 2 mesh of the page's axis names."""
    step = functional_step(minigpt_page()["train_step"])
    devices = np.array(jax.devices())
    stage = dict(device_axes=("batch", "model"))
    with register_task(r"embedding_layer|transformer_blocks\.layers\.[01]", devices=devices[:4].reshape(2, 2),
                       **stage), \
            register_task(r"transformer_blocks\.layers\.[23]|output_layer", devices=devices[4:].reshape(2, 2),
                          **stage):
        built = parallelize(step, init_params=minigpt_objects, get_input_batch=minigpt_batch,
                            mesh=jax.make_mesh(*MINIGPT_MESH))
    assert len(built[0].plan.placements) == 2
    losses, state = run_page(built, minigpt_loss)
    np.testing.assert_allclose(losses, minigpt_reference[0], rtol=1e-5)
    assert_states_close(state, minigpt_reference[1])
    model = state[0]
    assert {d.id for d in model.output_layer.kernel[...].sharding.device_set} == {4, 5, 6, 7}
    assert {d.id for d in model.embedding_layer.token_emb.embedding[...].sharding.device_set} == {0, 1, 2, 3}


# ----------------------------------------------------------------- the toy example "scan over layers"
WIDTH, LAYERS = 16, 4


def scan_mlp_objects() -> tuple:
    """The example's ``ScanMLP`` (the file run as it is: it builds and calls one at its own sizes) of 4 layers,
    and an optimizer."""
    with contextlib.redirect_stdout(None):
        scan_mlp = import_or_skip(f"tests/thirdparty/flax_nnx_guides/{SCAN_OVER_LAYERS.name}",
                                  lambda: runpy.run_path(str(SCAN_OVER_LAYERS)))["ScanMLP"]
    model = scan_mlp(WIDTH, n_layers=LAYERS, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.05, 0.9), wrt=nnx.Param)


def scan_mlp_batch() -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(1), (16, WIDTH))
    return x, jnp.sin(x)


def scan_mlp_step(model, optimizer, batch) -> jax.Array:
    """What a user of the example writes: an in-place NNX step (dropout on, batch statistics updated)."""
    x, y = batch
    value, grads = nnx.value_and_grad(lambda model: jnp.mean((model(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return value


def test_scan_over_layers_example_split_over_two_stages_equals_one_device():
    """Layers 0-1 on devices 0-3 and 2-3 on 4-7 by the stack's attribute name, the batch over each stage's 4
    devices: the scan's per-layer state (batch statistics, dropout streams) lives split with the parameters."""
    split = {(0, 2): ((0, 4), "first"), (2, 4): ((4, 8), "second")}
    with register_task(r"layers", split=split, dims=(4,), device_axes=("data",)):
        built = parallelize(functional_step(scan_mlp_step), init_params=scan_mlp_objects,
                            get_input_batch=scan_mlp_batch, mesh={"data": 8}, rules=[("batch", "data")])
    assert [p.name for p in built[0].plan.placements] == ["first", "second"]
    state, batch, losses = built[1](), built[2](), []
    for _ in range(STEPS):
        loss, state = built[0](state, batch)
        losses.append(float(loss))
    model, optimizer = scan_mlp_objects()
    reference = nnx.jit(scan_mlp_step)
    ref_losses = [float(reference(model, optimizer, scan_mlp_batch())) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_states_close(state, (model, optimizer))
    layers = state[0].layers
    for stacked in (layers.linear.kernel[...], layers.bn.mean[...], layers.dropout.rngs.count[...]):
        assert stacked.shape[0] == LAYERS and stacked.sharding.spec[0] == "stage"
        for shard in stacked.addressable_shards:  # layers [2s, 2s + 2) on stage s's devices only
            assert shard.data.shape[0] == 2 and shard.device.id // 4 == shard.index[0].start // 2
