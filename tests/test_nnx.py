"""The Flax NNX transformer (models/nnx_transformer.py) against the Linen one, and trained by the trainer
on the layout configs against its own one-device run; the schedule timeline picture.

Equivalence is checked with the same initial parameters (Linen's, converted with
``from_linen``), the same batches and the same optimizer: the loss curves must agree
to float tolerance over 20 steps on one device.
"""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.nnx_transformer import FunctionalModel, from_linen, to_linen
from models.transformer import Transformer, TransformerConfig
from multimesh.core.metadata import read_box
from multimesh.schedules import get_schedule
from multimesh.schedules import plot_schedule
from trainers.config import Config, load_config
from trainers.data import make_datasets
from trainers.layout import build_layout
from trainers.step import build_program
from trainers.train import train

SMALL = ["model.d_model=32", "model.max_len=32", "data.seq_len=32", "data.batch_size=8",
         "data.max_bytes=200000", "train.eval_batches=2", "train.eval_every=1000", "train.log_every=5"]
NNX_STEPS = 4
RTOL = 1e-4


def _paths(tree) -> dict[str, tuple]:
    return {jax.tree_util.keystr(p, simple=True, separator="/"): np.shape(x)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("tie, scan", [(True, False), (False, False), (False, True)])
def test_same_parameter_tree_names_and_outputs(tie, scan):
    """Also scanned: ``nn.scan`` and ``nnx.vmap`` + ``nnx.scan`` stack the same tree (leading ``layers`` axis)."""
    cfg = TransformerConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, max_len=16, tie_embeddings=tie,
                            scan_layers=scan)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    linen_vars = Transformer(cfg).init(jax.random.key(0), tokens)
    model = FunctionalModel(cfg)
    params = model.init(jax.random.key(3))
    # Same paths and shapes, same logical names on every parameter.
    assert _paths(to_linen(params)) == _paths(nn.meta.unbox(linen_vars))
    if scan:
        assert _paths(to_linen(params))["params/layers/mlp/wo/kernel"] == (2, cfg.d_ff, 32)
    linen_names = {jax.tree_util.keystr(p, simple=True, separator="/"): tuple(b.names)
                   for p, b in jax.tree_util.tree_flatten_with_path(
                       linen_vars["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]}
    nnx_names = {jax.tree_util.keystr(p, simple=True, separator="/"): read_box(v).spec
                 for p, v in jax.tree_util.tree_flatten_with_path(
                     params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}
    assert nnx_names == linen_names
    # Converted parameters give the same logits; converting back gives the Linen arrays.
    converted = from_linen(linen_vars, params)
    np.testing.assert_allclose(model.apply(converted, tokens), Transformer(cfg).apply(linen_vars, tokens),
                               rtol=1e-6, atol=1e-6)
    assert jax.tree.all(jax.tree.map(np.array_equal, to_linen(converted), nn.meta.unbox(linen_vars)))


def test_from_linen_names_a_mismatch():
    a = TransformerConfig(num_layers=2, d_model=32, num_heads=4, max_len=16, tie_embeddings=False)
    b = TransformerConfig(num_layers=2, d_model=32, num_heads=4, max_len=16)
    linen_vars = Transformer(a).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"only in Linen \['head/output/kernel'\]"):
        from_linen(linen_vars, FunctionalModel(b).init(0))


def test_api_is_validated():
    with pytest.raises(ValueError, match="api='jax'"):
        TransformerConfig(api="jax")
    assert load_config("tiny").model.api == "linen"
    assert load_config("tiny", ["model.api=nnx"]).model.api == "nnx"


def _program(cfg: Config):
    layout = build_layout(cfg.layout)
    train_ds, _, _ = make_datasets(cfg.data)
    with layout.tasks(cfg.model.num_layers):
        return build_program(cfg, layout, train_ds.batch_at(0), train_ds.batch_at(0)), train_ds


def test_nnx_follows_linen_for_20_steps_on_one_device(tmp_path):
    """Same initial parameters (Linen's, converted), same batches: the same loss curve and parameters."""
    base = load_config("tiny", [*SMALL, "model.num_layers=2", "layout.mesh={data: 1}", "train.steps=20",
                                f"train.out_dir={tmp_path}"])
    linen, data = _program(base)
    nnx_prog, _ = _program(base.replace(model={"api": "nnx"}))
    linen_state = linen.init()
    params = from_linen(jax.device_get(linen_state["params"]), jax.eval_shape(lambda: nnx_prog.model.init(0)))
    nnx_state = {"params": params, "opt": nnx_prog.optimizer.init(params)}
    # Both states on the step's shardings (one device), as the steps expect.
    nnx_state = jax.device_put(nnx_state, jax.tree.map(lambda a: a.sharding, nnx_prog.abstract_state))
    curves: dict[str, list[float]] = {"linen": [], "nnx": []}
    for s in range(20):
        batch = data.batch_at(s)
        m, linen_state = linen.step(linen_state, batch)
        curves["linen"].append(float(m["loss"]))
        m, nnx_state = nnx_prog.step(nnx_state, batch)
        curves["nnx"].append(float(m["loss"]))
    np.testing.assert_allclose(curves["nnx"], curves["linen"], rtol=1e-5)
    assert curves["linen"][-1] < curves["linen"][0] - 1.0  # it learns
    got = to_linen(jax.device_get(nnx_state["params"]))
    want = nn.meta.unbox(jax.device_get(linen_state["params"]))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got, want)
    assert isinstance(nnx_prog.model, FunctionalModel) and isinstance(linen.model, Transformer)


def _curve(cfg: Config, steps: int) -> tuple[list[float], object]:
    """The first ``steps`` train losses of ``cfg`` (the step called directly: no validation or
    checkpoints), and the final state."""
    program, data = _program(cfg)
    state, losses = program.init(), []
    for s in range(steps):
        metrics, state = program.step(state, data.batch_at(s))
        losses.append(float(metrics["loss"]))
    return losses, state


@pytest.fixture(scope="module")
def nnx_reference():
    """The NNX model's curve on one device for a config (once per model/data/optimizer)."""
    cache: dict = {}

    def get(cfg: Config, steps: int) -> list[float]:
        one = cfg.replace(name="one_device", layout={"mesh": {"data": 1}, "pipeline": None},
                          train={"out_dir": None})  # train.steps stays in the key: it shapes the lr schedule
        key = (repr(one.to_dict()), steps)
        if key not in cache:
            cache[key] = _curve(one, steps)[0]
        return cache[key]

    return get


def _nnx_config(name: str, tmp_path: Path, *extra: str) -> Config:
    depth = [] if "pipeline" in name else ["model.num_layers=2"]
    return load_config(name, [*SMALL, *depth, "model.api=nnx", f"train.out_dir={tmp_path}", *extra])


# tp in the default suite; the others (10 to 20 s each) with -m slow, for the default suite's 15 minutes
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "tp" else n
                                  for n in ("dp", "fsdp", "tp", "pipeline")])
def test_nnx_layout_matches_one_device(name, tmp_path, nnx_reference):
    cfg = _nnx_config(name, tmp_path)
    got, state = _curve(cfg, NNX_STEPS)
    np.testing.assert_allclose(got, nnx_reference(cfg, NNX_STEPS), rtol=RTOL,
                               err_msg=f"nnx {name} differs from one device")
    # The parameters are an nnx.State, sharded as the layout says (a pipeline: each stage on its devices).
    params = state["params"]
    assert isinstance(params, nnx.State)
    kernel = params["layers_0"]["mlp"]["wi_0"]["kernel"][...]
    if name == "pipeline":
        assert {d.id for d in kernel.sharding.device_set} == {0, 1, 2, 3}
        assert {d.id for d in params["head"]["final_norm"]["scale"][...].sharding.device_set} == {4, 5, 6, 7}
        assert kernel.addressable_shards[0].data.shape == (32, kernel.shape[1] // 2)  # tensor=2 on mlp
    else:
        assert len(kernel.sharding.device_set) == 8
        mlp_dim = kernel.shape[1]
        shard = kernel.addressable_shards[0].data.shape
        assert shard == {"dp": (32, mlp_dim), "fsdp": (32 // 8, mlp_dim), "tp": (32, mlp_dim // 8)}[name]


@pytest.mark.slow  # one of the longest checks: the default suite's time
def test_nnx_pipeline_with_remat_finds_stages_by_attribute_path(tmp_path, nnx_reference):
    """The NNX transformer opens no scope itself: the pipeline's registrations find ``embed``, ``layers_i``
    and ``head`` by attribute path, blocks run through ``nnx.remat`` included."""
    cfg = _nnx_config("pipeline", tmp_path, "model.remat=true")
    got, state = _curve(cfg, NNX_STEPS)
    np.testing.assert_allclose(got, nnx_reference(cfg, NNX_STEPS), rtol=RTOL)
    params = state["params"]
    assert {d.id for d in params["layers_0"]["mlp"]["wi_0"]["kernel"][...].sharding.device_set} == {0, 1, 2, 3}
    assert {d.id for d in params["head"]["final_norm"]["scale"][...].sharding.device_set} == {4, 5, 6, 7}


@pytest.mark.slow  # ~2 min: a whole pipeline run of the NNX model through train(), then sampling
def test_nnx_pipeline_run_writes_the_schedule_and_samples(tmp_path, nnx_reference):
    from trainers.sample import sample_text

    cfg = _nnx_config("pipeline", tmp_path, f"train.steps={NNX_STEPS}")
    result = train(cfg, quiet=True)
    got = [result.losses[s] for s in range(1, NNX_STEPS + 1)]
    np.testing.assert_allclose(got, nnx_reference(cfg, NNX_STEPS), rtol=RTOL)
    for name in ("schedule.png", "loss.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    text, ck = sample_text(tmp_path, "def ", 16, temperature=0.0)
    assert isinstance(ck.model, FunctionalModel) and ck.step == NNX_STEPS and 0 < len(text) <= 16


def test_sampling_works_for_both_apis():
    """Greedy decoding gives the same bytes from the Linen model and the NNX model on converted parameters."""
    from trainers.sample import generate

    cfg = TransformerConfig(num_layers=2, d_model=32, num_heads=4, max_len=16)
    linen_vars = Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    model = FunctionalModel(cfg)
    params = from_linen(linen_vars, model.init(0))
    prompt = np.frombuffer(b"def ", np.uint8)
    a = generate(Transformer(cfg), nn.meta.unbox(linen_vars), prompt, 12, window=16, temperature=0.0)
    b = generate(model, params, prompt, 12, window=16, temperature=0.0)
    np.testing.assert_array_equal(a, b)
    assert len(b) == 12


# -- the schedule's picture ------------------------------------------------------------------------


@pytest.mark.parametrize("name, stages, micro", [("gpipe", 2, 4), ("1f1b", 4, 8), ("zb-h1", 3, 4)])
def test_schedule_png_has_a_box_per_action(name, stages, micro, tmp_path):
    schedule = get_schedule(name, num_stages=stages, num_microbatches=micro)
    path = tmp_path / f"{name}.png"
    boxes = plot_schedule(schedule, path)
    assert boxes == len(schedule) == (3 if schedule.split_backward else 2) * stages * micro
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_schedule_png_shows_bubbles(tmp_path):
    """Bubbles are drawn empty: the share of the picture left in the lanes' colour follows the bubble
    fraction (2-stage GPipe: 1/2 with 1 microbatch, 1/9 with 8)."""
    import matplotlib.image as mpimg

    def idle_share(micro: int) -> float:
        path = tmp_path / f"g{micro}.png"
        plot_schedule(get_schedule("gpipe", 2, micro), path)
        img = (mpimg.imread(path)[..., :3] * 255).round().astype(int)
        lane = (img == [0xF4, 0xF4, 0xF4]).all(-1).sum()
        boxes = ((img != [0xF4, 0xF4, 0xF4]).any(-1) & (img != 255).any(-1)).sum()
        return lane / (lane + boxes)

    few, many = idle_share(1), idle_share(8)
    assert few > 0.3 and many < few / 2


def test_cli_plan_writes_the_picture(tmp_path, capsys):
    from trainers.cli import main

    assert main(["pipeline", "--plan", f"train.out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "stage 0 | F0" in out and "OneFOneB" in out
    assert (tmp_path / "schedule.png").stat().st_size > 5000
    assert main(["dp", "--plan", f"train.out_dir={tmp_path / 'dp'}"]) == 0
    assert "no pipeline" in capsys.readouterr().out and not Path(tmp_path / "dp" / "schedule.png").exists()
