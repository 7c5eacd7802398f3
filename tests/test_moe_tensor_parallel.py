"""Expert tensor parallelism in the example MoE layer (models/moe.py): on a mesh where the rules map the
experts' hidden axis ``mlp`` to a ``tensor`` axis, each device holds and computes ``d_ff / tensor`` of every
one of its experts' hidden units, and the partial outputs are summed over ``tensor``.

Each layout (with and without an ``expert`` axis) is compared with the same program on one device: the
layer's outputs and gradients, and 3 optimizer steps of the small MoE transformer (losses and every
parameter). The shardings are read from the arrays, and the compiled step is read for collectives that
would gather an expert's weights whole.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_moe import CFG, ONE_DEVICE, D, E, F, _assert_close, _parallel, _run, _x, dense_reference, params_of, small

from models.moe import MoeBlock, TransformerConfig
from multimesh.estimate.collectives import find_collectives
from multimesh.estimate.hlo import parse_module
from multimesh.jax import parallelize, register_task, resolve_in_scope, standard_rules
from trainers.config import ConfigError, load_config
from trainers.step import program_for, zeros_batch

#: the layouts of expert tensor parallelism: with an expert axis (all-to-all, then tensor), and without one
MESHES = [{"expert": 2, "tensor": 2, "data": 2}, {"tensor": 2, "data": 4}, {"expert": 4, "tensor": 2}]
IDS = ["expert2-tensor2-data2", "tensor2-data4", "expert4-tensor2"]
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@pytest.fixture(scope="module")
def layer():
    block = MoeBlock(CFG)
    return block, nn.meta.unbox(block.init(jax.random.key(0), _x()))["params"]


def _one_device(block: MoeBlock, p: dict, x: jax.Array):
    """The layer's output and the gradients of the tests' loss on one device (no mesh: every expert local)."""

    def loss(q):
        y = block.apply({"params": q}, x, mutable=["intermediates"])[0]
        return jnp.sum(jnp.sin(y)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(p)
    return y, grads


def _collective_shapes(hlo: str) -> list[tuple[str, str]]:
    """(kind, result shape text) of every collective of a compiled program."""
    out = []
    for body in parse_module(hlo).computations.values():
        for ins in body:
            kind = ins.opcode.removesuffix("-start").removesuffix("-done")
            if kind in COLLECTIVES and not ins.opcode.endswith("-done"):
                out.append((kind, ins.shape))
    return out


def _whole_expert_weights(hlo: str, experts: int, d: int, f: int) -> list[tuple[str, str]]:
    """The collectives whose result holds ``experts`` experts' weights with all ``f`` hidden units: [E, D, F]
    or [E, F, D] (alone or in a tuple), i.e. an expert's weight or its gradient gathered or reduced whole."""
    whole = {f"[{experts},{d},{f}]", f"[{experts},{f},{d}]"}
    return [(kind, shape) for kind, shape in _collective_shapes(hlo)
            if any(dims in whole for dims in re.findall(r"\[[\d,]+\]", shape))]


# -- the layer ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh", MESHES, ids=IDS)
def test_the_layer_equals_one_device_outputs_and_gradients(layer, mesh):
    block, p = layer
    x = _x((8, 6, D))
    (y, _, grads), params, text = _parallel(block, x, mesh)
    want_y, want_grads = _one_device(block, p, x)
    _assert_close(y, want_y)
    _assert_close(grads, want_grads, atol=1e-4)
    _assert_close(y, dense_reference(p, x))  # and the definition
    n, t = mesh.get("expert", 1), mesh["tensor"]
    for name, f_dim in (("wi_0", 2), ("wi_1", 2), ("wo", 1)):  # each device: E / n experts, F / t of each
        w = params[name]
        assert w.sharding.spec[f_dim] == "tensor", (name, w.sharding.spec)
        assert {s.data.shape[f_dim] for s in w.addressable_shards} == {F // t}
        assert {s.data.shape[0] for s in w.addressable_shards} == {E // n}
        assert len({(s.index[0].start, s.index[f_dim].start) for s in w.addressable_shards}) == n * t
    assert _whole_expert_weights(text, E // n, D, F) == []
    assert ("all-to-all" in text) == (n > 1)


def test_without_an_expert_axis_the_tensor_sum_is_one_all_reduce_of_the_devices_tokens(layer):
    """{tensor: 2, data: 4}: the partial outputs are summed over tensor at [its tokens, D] per device, after the
    gates' combine (not over the token copies, k times more), and the tokens stay split over data: no
    collective holds the batch's token copies (48 tokens x top-2 = 96 rows)."""
    block, _ = layer
    x = _x((8, 6, D))
    mesh = {"tensor": 2, "data": 4}
    _, _, text = _parallel(block, x, mesh)
    found = find_collectives(text, tuple(mesh), tuple(mesh.values()))
    over_tensor = [c for c in found if c.axes == ("tensor",)]
    assert over_tensor and max(c.bytes for c in over_tensor) == (8 * 6 // 4) * D * 4, over_tensor
    copies = [(kind, shape) for kind, shape in _collective_shapes(text) if re.search(r"\[96[,\]]", shape)]
    assert copies == [], copies


def test_bfloat16_partial_outputs_are_summed_in_bfloat16():
    """model.dtype bfloat16: the one tensor sum of the forward (a device's 12 tokens) is sent in bfloat16."""
    block = MoeBlock(TransformerConfig(d_model=D, num_heads=2, d_ff=F, num_experts=E, experts_per_token=2,
                                       dtype="bfloat16"))
    x = _x((8, 6, D))
    mesh = {"expert": 2, "tensor": 2, "data": 2}
    step, init = parallelize(lambda q, b: block.apply({"params": q}, b["x"], mutable=["intermediates"])[0],
                             init_params=lambda: block.init(jax.random.key(0), x)["params"],
                             initial_batch={"x": x}, mesh=mesh, rules=standard_rules(tuple(mesh)))
    lowered = step.lower(init(), {"x": x}).as_text()
    sums = re.findall(r'"stablehlo.all_reduce".*?\}\) : \(tensor<([^>]+)>\)', lowered, re.S)  # operand types
    assert sums == [f"{8 * 6 // 4}x{D}xbf16"], sums


def test_d_ff_the_tensor_axis_does_not_divide_names_both_and_the_fix():
    block = MoeBlock(TransformerConfig(d_model=D, num_heads=2, d_ff=30, num_experts=E, experts_per_token=2))
    with pytest.raises(ValueError, match=r"d_ff=30 is not divisible by the mesh axis 'tensor' of size 4 .*'mlp'"
                                         r".*make d_ff a multiple of 4, or that axis a divisor of 30"):
        _parallel(block, _x((8, 6, D)), {"expert": 2, "tensor": 4})
    with pytest.raises(ConfigError, match=r"model.d_ff=60 is not divisible by the tensor axis of layout.mesh "
                                          r"\(size 8\).*multiple of 8"):
        load_config("moe", ["model.d_ff=60", "layout.mesh={tensor: 8}"])


# -- the transformer, trained ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    cfg = small("moe", out, "train.steps=3", "model.num_layers=2").replace(layout=ONE_DEVICE)
    return _run(cfg, 3)


def _mesh_override(mesh: dict[str, int]) -> str:
    return "layout.mesh={" + ", ".join(f"{a}: {s}" for a, s in mesh.items()) + "}"


@pytest.mark.parametrize("mesh", MESHES, ids=IDS)
def test_the_transformer_trains_like_one_device(mesh, one_device_run, tmp_path):
    """3 optimizer steps of the small MoE transformer on the layout against one device: every step's loss and
    every parameter after them; the experts' weights split over tensor on the trained state; and no collective
    of the compiled step gathers (or reduces) an expert weight with all its hidden units."""
    cfg = small("moe", tmp_path, "train.steps=3", "model.num_layers=2", _mesh_override(mesh))
    got, got_losses = _run(cfg, 3)
    want, want_losses = one_device_run
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    _assert_close(params_of(got), params_of(want), rtol=1e-4, atol=1e-6)
    n, t, f, e = mesh.get("expert", 1), mesh["tensor"], cfg.model.d_ff, cfg.model.num_experts
    mlp = nn.meta.unbox(got.state["params"])["params"]["layers_0"]["mlp"]
    assert {s.data.shape for s in mlp["wi_0"].addressable_shards} == {(e // n, cfg.model.d_model, f // t)}
    assert {s.data.shape for s in mlp["wo"].addressable_shards} == {(e // n, f // t, cfg.model.d_model)}
    program = program_for(cfg)
    hlo = program.step.lower(program.abstract_state, zeros_batch(cfg)).compile().as_text()
    assert _whole_expert_weights(hlo, e // n, cfg.model.d_model, f) == []


@pytest.mark.slow  # ~30 s: a 2-stage pipeline and its one-device reference
def test_a_pipeline_whose_stages_split_their_experts_over_tensor_trains_like_one_device(tmp_path):
    """moe_pipeline with each stage shaped expert=2 x tensor=2: the MoE layer's shard_map runs on its stage's
    submesh, all-to-all over the stage's expert axis and the tensor sum over its tensor axis; 2 steps against
    one device, each stage's experts split over its own devices, d_ff / 2 of each on a device, and no stage
    program gathers its experts' weights whole."""
    cfg = small("moe_pipeline", tmp_path / "run", "train.steps=2", "model.num_layers=2",
                "layout.pipeline.microbatches=2", "layout.mesh={expert: 2, tensor: 2}")
    got, got_losses = _run(cfg, 2)
    want, want_losses = _run(cfg.replace(layout=ONE_DEVICE, train={"out_dir": str(tmp_path / "one")}), 2)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    _assert_close(params_of(got), params_of(want), rtol=1e-4, atol=1e-6)
    e, d, f = cfg.model.num_experts, cfg.model.d_model, cfg.model.d_ff
    for stage in (0, 1):
        wo = nn.meta.unbox(got.state["params"])["params"][f"layers_{stage}"]["mlp"]["wo"]
        assert {dev.id // 4 for dev in wo.sharding.device_set} == {stage}
        assert {s.data.shape for s in wo.addressable_shards} == {(e // 2, f // 2, d)}
    whole = (e // 2) * d * f * 4  # a stage device's experts' weight with all its hidden units, float32
    gathers = [(c.kind, c.axes, c.bytes) for program in program_for(cfg).step.estimate().programs
               for c in program.collectives if c.kind == "all-gather" and c.bytes >= whole]
    assert gathers == [], gathers


def test_resolve_in_scope_gives_the_rules_in_force_a_stage_its_own_and_no_rules_the_spec():
    """What the layer sums over: the step's rules while parallelize traces it; inside a registered stage the
    stage's own rules (here mlp over its axis 'b'); with no rules in force, the spec as given."""
    seen: dict[str, P] = {}

    def fun(p, b):
        seen["step"] = resolve_in_scope(P("mlp", ("batch", "expert")))
        with jax.named_scope("stage"):
            seen["stage"] = resolve_in_scope(P("mlp", "batch"))
            y = jnp.sum(p["w"] * b["x"])
        return y + 1.0

    assert resolve_in_scope(P("mlp")) == P("mlp")
    mesh = {"data": 2, "expert": 2, "tensor": 2}
    parallelize(fun, init_params=lambda: {"w": jnp.ones(8)}, initial_batch={"x": jnp.ones(8)}, mesh=mesh,
                rules=standard_rules(tuple(mesh)))
    assert seen["step"] == P("tensor", ("data", "expert"))
    with register_task("stage", devices=jax.devices()[:4], dims=(2, 2), device_axes=("a", "b"),
                       logical_axes=[("mlp", "b"), ("batch", "a")]):
        parallelize(fun, init_params=lambda: {"w": jnp.ones(8)}, initial_batch={"x": jnp.ones(8)})
    assert seen["stage"] == P("b", "a")


@pytest.mark.slow  # ~25 s: the NNX model on a layout and on one device
def test_the_nnx_model_with_tensor_parallel_experts_trains_like_one_device(tmp_path):
    """model.api=nnx (NnxMoeBlock: the same layer function) on expert=2 x tensor=2 x data=2, 2 steps."""
    cfg = small("moe", tmp_path / "nnx", "train.steps=2", "model.num_layers=2", "model.api=nnx",
                _mesh_override(MESHES[0]))
    got, got_losses = _run(cfg, 2)
    want, want_losses = _run(cfg.replace(layout=ONE_DEVICE, train={"out_dir": str(tmp_path / "one")}), 2)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    _assert_close(params_of(got), params_of(want), rtol=1e-4, atol=1e-6)
    shards = {leaf.addressable_shards[0].data.shape for leaf in jax.tree.leaves(got.state["params"])
              if leaf.ndim == 3 and leaf.shape[0] == cfg.model.num_experts}
    assert shards == {(cfg.model.num_experts // 2, cfg.model.d_model, cfg.model.d_ff // 2),
                      (cfg.model.num_experts // 2, cfg.model.d_ff // 2, cfg.model.d_model)}
