"""The Mixture-of-Experts feed-forward (models/moe.py) and its trainer configs (moe, moe_pipeline).

The layer is compared with a dense reference written here (every expert run on every token, the
outputs weighted by the gates: no sorting, no ragged products, no collectives), on one device and
with expert parallelism (all-to-all over the mesh's ``expert`` axis); the trainer's layouts with
the same config run on one device, as in tests/test_trainer.py.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.moe import (
    MoeBlock,
    NnxMoeBlock,
    expert_capacity,
    experts_local,
    load_balancing_loss,
    route,
    sown_aux_loss,
)
from models.nnx_transformer import FunctionalModel, from_linen
from models.transformer import Transformer, TransformerConfig
from multimesh.checkpoint import CheckpointManager
from multimesh.jax import mesh_in_scope, parallelize, standard_rules
from trainers.config import ConfigError, ConfigWarning, load_config
from trainers.step import program_for
from trainers.train import train

E, K, D, F = 8, 2, 16, 32
CFG = TransformerConfig(d_model=D, num_heads=2, d_ff=F, num_experts=E, experts_per_token=K)
RTOL, ATOL = 1e-5, 1e-5


def _x(shape: tuple[int, ...] = (4, 6, D), seed: int = 1) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape)


def dense_reference(p: dict, x: jax.Array, k: int = K) -> jax.Array:
    """The MoE by its definition: every expert on every token, each output weighted by the token's
    renormalised top-k probability for that expert (0 for the experts it did not pick)."""
    probs = jax.nn.softmax(x @ p["router"], axis=-1)
    top, ids = jax.lax.top_k(probs, k)
    gates = top / jnp.sum(top, axis=-1, keepdims=True)
    out = jnp.zeros_like(x)
    for e in range(p["router"].shape[-1]):
        y = (jax.nn.silu(x @ p["wi_0"][e]) * (x @ p["wi_1"][e])) @ p["wo"][e]
        out = out + jnp.sum(jnp.where(ids == e, gates, 0.0), axis=-1)[..., None] * y
    return out


@pytest.fixture(scope="module")
def layer():
    """(Linen MoeBlock, its plain parameters)."""
    block = MoeBlock(CFG)
    return block, nn.meta.unbox(block.init(jax.random.key(0), _x()))["params"]


def _apply(block: MoeBlock, params: dict, x: jax.Array) -> jax.Array:
    return block.apply({"params": params}, x, mutable=["intermediates"])[0]


def _assert_close(got, want, rtol=RTOL, atol=ATOL):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# -- the layer on one device ---------------------------------------------------------------------------------


def test_linen_layer_equals_the_dense_reference_outputs_and_gradients(layer):
    block, p = layer
    x = _x()
    _assert_close(jax.jit(lambda p, x: _apply(block, p, x))(p, x), dense_reference(p, x))
    loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))  # noqa: E731
    got = jax.jit(jax.grad(loss(lambda p, x: _apply(block, p, x)), argnums=(0, 1)))(p, x)
    _assert_close(got, jax.grad(loss(dense_reference), argnums=(0, 1))(p, x), atol=1e-4)
    assert set(p) == {"router", "wi_0", "wi_1", "wo"}


def test_nnx_layer_equals_the_linen_layer_and_the_reference(layer):
    block, p = layer
    x = _x()
    with nnx.use_eager_sharding(False):  # on one device: the logical names are not mesh axes
        nnx_block = NnxMoeBlock(CFG, nnx.Rngs(0))
    for name, value in p.items():
        getattr(nnx_block, name)[...] = value
    graphdef, state = nnx.split(nnx_block)

    def run(state, x):
        return nnx.capture(nnx.merge(graphdef, state), nnx.Intermediate)(x)[0]

    _assert_close(jax.jit(run)(state, x), dense_reference(p, x))
    got = jax.grad(lambda s: jnp.sum(jnp.sin(run(s, x))))(state)
    want = jax.grad(lambda q: jnp.sum(jnp.sin(dense_reference(q, x))))(p)
    _assert_close([got[n][...] for n in sorted(p)], [want[n] for n in sorted(p)], atol=1e-4)


def test_the_layer_sows_its_load_balancing_loss(layer):
    block, p = layer
    x = _x()
    _, sown = block.apply({"params": p}, x, mutable=["intermediates"])
    _, _, probs = route(x, p["router"], K)
    ids = route(x, p["router"], K)[0]
    np.testing.assert_allclose(float(sown_aux_loss(sown)), float(load_balancing_loss(probs, ids)), rtol=1e-6)


def test_routing_gives_each_token_k_distinct_experts_with_gates_summing_to_one(layer):
    _, p = layer
    x = _x((64, D), 3)
    ids, gates, probs = route(x, p["router"], K)
    assert ids.shape == gates.shape == (64, K) and ids.dtype == jnp.int32
    assert all(len(set(row)) == K for row in np.asarray(ids).tolist())
    np.testing.assert_allclose(np.asarray(gates.sum(-1)), 1.0, rtol=1e-6)
    picked = np.take_along_axis(np.asarray(probs), np.asarray(ids), axis=-1)
    np.testing.assert_allclose(np.asarray(gates), picked / picked.sum(-1, keepdims=True), rtol=1e-6)
    assert (picked.min(-1) >= np.sort(np.asarray(probs), -1)[:, -K]).all()  # the k largest
    assert len(set(np.asarray(ids).ravel().tolist())) > K  # the router spreads tokens: the checks mean something


def test_load_balancing_loss_of_a_hand_computed_case():
    # one sequence of 2 tokens, 4 experts, top-2: token 0 -> experts 0, 1; token 1 -> experts 0, 2
    probs = jnp.array([[0.4, 0.3, 0.2, 0.1], [0.5, 0.1, 0.3, 0.1]])
    ids = jnp.array([[0, 1], [0, 2]])
    # f = (2/4, 1/4, 1/4, 0), P = (0.45, 0.2, 0.25, 0.1): 4 * (0.225 + 0.05 + 0.0625) = 1.35
    np.testing.assert_allclose(float(load_balancing_loss(probs, ids)), 1.35, rtol=1e-6)
    even = jnp.full((4, 4), 0.25)
    np.testing.assert_allclose(float(load_balancing_loss(even, jnp.array([[0], [1], [2], [3]]))), 1.0, rtol=1e-6)
    # two sequences: the mean of their own losses (2 experts, top-1: 2 * 1 * 0.7 = 1.4 and 2 * 0.5 = 1.0)
    batch_probs = jnp.array([[[0.8, 0.2], [0.6, 0.4]], [[0.5, 0.5], [0.5, 0.5]]])
    batch_ids = jnp.array([[[0], [0]], [[0], [1]]])
    np.testing.assert_allclose(float(load_balancing_loss(batch_probs, batch_ids)), 1.2, rtol=1e-6)


def test_local_experts_sort_tokens_into_groups_and_back():
    """The grouped products see each expert's rows together; a permutation of the tokens permutes the output."""
    x = _x((10, D), 5)
    ids = jnp.array([[i % E, (i * 3 + 1) % E] for i in range(10)], jnp.int32)
    gates = jnp.full((10, 2), 0.5)
    w = [_x((E, D, F), 6) * 0.2, _x((E, D, F), 7) * 0.2, _x((E, F, D), 8) * 0.2]
    y = experts_local(x, ids, gates, *w)
    perm = jnp.array([3, 9, 0, 1, 7, 2, 8, 4, 6, 5])
    _assert_close(experts_local(x[perm], ids[perm], gates[perm], *w), y[perm])
    want = sum(0.5 * ((jax.nn.silu(x @ w[0][e]) * (x @ w[1][e])) @ w[2][e]) * (ids == e).any(-1)[:, None]
               for e in range(E))
    _assert_close(y, want)


# -- expert parallelism --------------------------------------------------------------------------------------


def _parallel(block: MoeBlock, x: jax.Array, mesh: dict[str, int], rules=None):
    """The layer's output and parameter gradients under parallelize on ``mesh`` (standard rules), the
    initialised parameters, and the compiled step's text."""

    def fun(params, batch):
        def loss(q):
            y, sown = block.apply({"params": q}, batch["x"], mutable=["intermediates"])
            return jnp.sum(jnp.sin(y)), (y, sown_aux_loss(sown))

        (_, (y, aux)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return y, aux, grads

    step, init = parallelize(fun, init_params=lambda: block.init(jax.random.key(0), x)["params"],
                             initial_batch={"x": x}, mesh=mesh,
                             rules=standard_rules(tuple(mesh)) if rules is None else rules)
    params = init()
    y, aux, grads = step(params, {"x": x})
    text = step.lower(params, {"x": x}).compile().as_text()
    return (y, aux, nn.meta.unbox(grads)), nn.meta.unbox(params), text


@pytest.mark.parametrize("mesh", [{"data": 2, "expert": 4}, {"fsdp": 2, "expert": 2, "data": 2},
                                  {"data": 8, "expert": 1}])
def test_expert_parallel_layer_equals_the_dense_reference(layer, mesh):
    block, p = layer
    x = _x((8, 6, D))
    (y, aux, grads), params, text = _parallel(block, x, mesh)
    _assert_close(y, dense_reference(p, x))
    _assert_close(grads, jax.grad(lambda q: jnp.sum(jnp.sin(dense_reference(q, x))))(p), atol=1e-4)
    _, ids, probs = (lambda r: (r[1], r[0], r[2]))(route(x, p["router"], K))
    np.testing.assert_allclose(float(aux), float(load_balancing_loss(probs, ids)), rtol=1e-5)
    ways = mesh.get("expert", 1)
    assert ("all-to-all" in text) == (ways > 1)  # tokens travel only where experts are split
    for name in ("wi_0", "wi_1", "wo"):  # each device holds E / ways experts, whole
        assert {s.data.shape[0] for s in params[name].addressable_shards} == {E // ways}
        first_expert = {d.id: index[0].start or 0 for d, index in
                        params[name].sharding.devices_indices_map(params[name].shape).items()}
        assert sorted(set(first_expert.values())) == list(range(0, E, E // ways))  # every expert somewhere
        if ways > 1:
            assert tuple(params[name].sharding.spec)[:1] == ("expert",)


def test_tokens_the_rules_leave_whole_over_the_expert_axis_are_split_there(layer):
    """Rules that split the experts but not the batch over ``expert``: inside the layer each device of the
    axis takes its share of the (same) tokens, and the output is whole again after it."""
    block, p = layer
    x = _x((2, 4, D), 9)
    with pytest.warns(UserWarning, match="no rule names the batch's logical name 'batch'"):
        (y, _, grads), params, text = _parallel(block, x, {"data": 2, "expert": 4}, rules=[("expert", "expert")])
    assert "all-to-all" in text and {s.data.shape[0] for s in params["wo"].addressable_shards} == {E // 4}
    _assert_close(y, dense_reference(p, x))
    _assert_close(grads, jax.grad(lambda q: jnp.sum(jnp.sin(dense_reference(q, x))))(p), atol=1e-4)


def test_an_expert_count_the_expert_axis_does_not_divide_is_refused_by_the_layer():
    block = MoeBlock(TransformerConfig(d_model=D, num_heads=2, d_ff=F, num_experts=6, experts_per_token=2))
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the mesh's 'expert' axis of size 4"):
        _parallel(block, _x((8, 6, D)), {"data": 2, "expert": 4})


def test_mesh_in_scope_is_none_on_one_device_and_the_step_mesh_while_parallelize_traces():
    seen = []

    def fun(p, b):
        seen.append(mesh_in_scope())
        return jnp.sum(p["w"] * b["x"])

    assert mesh_in_scope() is None
    parallelize(fun, init_params=lambda: {"w": jnp.ones(8)}, initial_batch={"x": jnp.ones(8)},
                mesh={"data": 2, "expert": 4})
    assert seen and all(dict(m.shape) == {"data": 2, "expert": 4} for m in seen)


# -- capacity ------------------------------------------------------------------------------------------------


def kept_copies(ids: np.ndarray, capacity: int) -> np.ndarray:
    """[N, k] bools: whether each token copy is among the first ``capacity`` copies its expert receives,
    counting tokens in order (GShard / Switch capacity, "position" drop policy)."""
    seen: dict[int, int] = {}
    kept = np.zeros(ids.shape, bool)
    for t, row in enumerate(ids.tolist()):
        for j, e in enumerate(row):
            kept[t, j] = seen.get(e, 0) < capacity
            seen[e] = seen.get(e, 0) + 1
    return kept


def numpy_experts(x, ids, gates, kept, w) -> np.ndarray:
    """Each kept copy's expert output, weighted by its gate and summed per token, in NumPy (float64)."""
    x, w0, w1, w2 = (np.asarray(a, np.float64) for a in (x, *w))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(ids)[t].tolist()):
            if kept[t, j]:
                h = x[t] @ w0[e]
                out[t] += float(gates[t, j]) * ((h / (1 + np.exp(-h))) * (x[t] @ w1[e])) @ w2[e]
    return out


def _expert_weights(e: int = E, seed: int = 6) -> list[jax.Array]:
    return [_x((e, D, F), seed) * 0.2, _x((e, D, F), seed + 1) * 0.2, _x((e, F, D), seed + 2) * 0.2]


def test_a_capacity_drops_exactly_the_copies_past_it_in_token_order():
    """4 experts, top-2, 6 tokens, factor 0.5: capacity ceil(0.5 x 6 x 2 / 4) = 2 copies per expert. Expert 0
    gets tokens 0, 1, 2, 3 (keeps 0, 1), expert 1 tokens 0, 2, 4, 5 (keeps 0, 2), experts 2 and 3 two each."""
    ids = jnp.array([[0, 1], [0, 2], [0, 1], [3, 0], [1, 2], [1, 3]], jnp.int32)
    hand = np.array([[1, 1], [1, 1], [0, 1], [1, 0], [0, 1], [0, 1]], bool)
    assert expert_capacity(6, 2, 4, 0.5) == 2 and (kept_copies(np.asarray(ids), 2) == hand).all()
    x, gates, w = _x((6, D), 5), jax.random.uniform(jax.random.key(3), (6, 2)), _expert_weights(4)
    got = experts_local(x, ids, gates, *w, capacity=2)
    np.testing.assert_allclose(np.asarray(got), numpy_experts(x, ids, gates, hand, w), rtol=1e-5, atol=1e-5)
    dropless = experts_local(x, ids, gates, *w)
    np.testing.assert_allclose(np.asarray(dropless), numpy_experts(x, ids, gates, np.ones_like(hand), w),
                               rtol=1e-5, atol=1e-5)
    assert expert_capacity(6, 2, 4, 2.0) == 6 and expert_capacity(6, 2, 4, None) is None  # at most N: all


def _capped(factor: float | None) -> MoeBlock:
    return MoeBlock(TransformerConfig(d_model=D, num_heads=2, d_ff=F, num_experts=E, experts_per_token=K,
                                      moe_capacity_factor=factor))


def test_a_capacity_that_drops_nothing_equals_the_dropless_layer_on_one_device_and_expert_parallel(layer):
    """Factor E / k: every expert may take every token of a group, so nothing drops: outputs and gradients equal
    the dense reference on one device and with expert=4 on 8 devices."""
    block, p = layer
    x = _x((8, 6, D))
    capped = _capped(E / K)
    _assert_close(_apply(capped, p, x), dense_reference(p, x))
    (y, _, grads), _, text = _parallel(capped, x, {"data": 2, "expert": 4})
    assert "all-to-all" in text
    _assert_close(y, dense_reference(p, x))
    _assert_close(grads, jax.grad(lambda q: jnp.sum(jnp.sin(dense_reference(q, x))))(p), atol=1e-4)


def test_expert_parallel_capacity_is_per_source_device_and_drops_past_it(layer):
    """With expert=4 on 8 devices each device's 6 tokens are a group: capacity ceil(0.5 x 6 x 2 / 8) = 1 copy
    per expert from each device; the output equals the NumPy reference that keeps, in each device's block of
    tokens, each expert's first copy only."""
    block, p = layer
    x = _x((8, 6, D))
    (y, _, _), _, _ = _parallel(_capped(0.5), x, {"data": 2, "expert": 4})
    tokens = np.asarray(x).reshape(-1, D)
    ids, gates, _ = route(jnp.asarray(tokens), p["router"], K)
    ids, gates = np.asarray(ids), np.asarray(gates)
    w = [p["wi_0"], p["wi_1"], p["wo"]]
    want = np.concatenate([numpy_experts(tokens[s:s + 6], ids[s:s + 6], gates[s:s + 6],
                                         kept_copies(ids[s:s + 6], 1), w) for s in range(0, 48, 6)])
    assert not kept_copies(ids[:6], 1).all()  # some copies do drop
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want, rtol=1e-4, atol=1e-5)


def _all_to_all_bytes(block: MoeBlock, x: jax.Array, mesh: dict[str, int], dtype: str = "float32") -> int:
    def fun(params, batch):
        return jax.grad(lambda q: jnp.sum(block.apply({"params": q}, batch["x"], mutable=["intermediates"])[0]))(
            params)

    step, _ = parallelize(fun, init_params=lambda: block.init(jax.random.key(0), x)["params"],
                          initial_batch={"x": x}, mesh=mesh, rules=standard_rules(tuple(mesh)))
    (program,) = step.estimate().programs
    return sum(c.bytes * c.count for c in program.collectives if c.kind == "all-to-all")


def test_a_capacity_shrinks_the_all_to_all_bytes_by_its_slots_over_the_dropless_ones():
    """expert=4 on 8 devices, 6 tokens per device, top-2 of 8 experts: dropless, each destination gets a slot
    per copy, 12; factor 1: capacity ceil(6 x 2 / 8) = 2 copies per expert, 2 experts per device: 4 slots. Every
    all-to-all (tokens, their expert ids, results, and the gradients') shrinks by 4 / 12."""
    x, mesh = _x((8, 6, D)), {"data": 2, "expert": 4}
    dropless, capped = _all_to_all_bytes(_capped(None), x, mesh), _all_to_all_bytes(_capped(1.0), x, mesh)
    assert dropless > 0 and capped * 12 == dropless * 4


def test_tokens_travel_in_the_compute_dtype():
    """model.dtype bfloat16: the program JAX emits sends the copies and the experts' outputs in bfloat16, and
    the estimate counts them so (XLA:CPU widens a bfloat16 all-to-all to float32; a GPU sends bfloat16). Per
    device, factor 1: 4 destinations x 4 slots of 16 features, out and back, the results' gradient back, and
    the slots' expert ids (int32)."""
    x, mesh = _x((8, 6, D)), {"data": 2, "expert": 4}
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        block = MoeBlock(TransformerConfig(d_model=D, num_heads=2, d_ff=F, num_experts=E, experts_per_token=K,
                                           dtype=dtype, moe_capacity_factor=1.0))
        assert _all_to_all_bytes(block, x, mesh) == 3 * (4 * 4 * D * itemsize) + 4 * 4 * 4
    step, init = parallelize(lambda q, b: block.apply({"params": q}, b["x"], mutable=["intermediates"])[0],
                             init_params=lambda: block.init(jax.random.key(0), x)["params"],
                             initial_batch={"x": x}, mesh=mesh, rules=standard_rules(tuple(mesh)))
    emitted = [line for line in step.lower(init(), {"x": x}).as_text().splitlines() if "all_to_all" in line]
    assert emitted and all("xbf16>" in line or "xi32>" in line for line in emitted), emitted


# -- bad input -----------------------------------------------------------------------------------------------


def test_top_k_larger_than_the_expert_count_names_both():
    with pytest.raises(ConfigError, match=r"experts_per_token=5 .* num_experts=4"):
        load_config("moe", ["model.num_experts=4", "model.experts_per_token=5"])
    with pytest.raises(ValueError, match=r"experts_per_token=3 .* num_experts=2"):
        TransformerConfig(num_experts=2, experts_per_token=3)


def test_a_capacity_factor_not_above_zero_is_refused_by_name():
    for bad in ("0", "-1.25"):
        with pytest.raises(ConfigError, match=rf"model: moe_capacity_factor={float(bad)} must be > 0.*unset"):
            load_config("moe", [f"model.moe_capacity_factor={bad}"])
    assert load_config("moe", ["model.moe_capacity_factor=1.25"]).model.moe_capacity_factor == 1.25
    assert load_config("moe").model.moe_capacity_factor is None


def test_an_expert_count_the_expert_axis_does_not_divide_names_both_and_the_fix():
    with pytest.raises(ConfigError, match=r"model.num_experts=6 is not divisible by the expert axis of "
                                          r"layout.mesh \(size 4\).*multiple of 4"):
        load_config("moe", ["model.num_experts=6"])


def test_an_expert_axis_without_experts_warns():
    with pytest.warns(ConfigWarning, match=r"expert axis of size 4, but the model has no experts"):
        load_config("moe", ["model.num_experts=0"])
    with pytest.warns(ConfigWarning, match=r"expert axis of size 2, but the model has no experts"):
        load_config("moe_pipeline", ["model.num_experts=0"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("moe")


# -- the model and the trainer -------------------------------------------------------------------------------


def test_moe_every_places_experts_in_every_nth_block_in_linen_and_nnx():
    cfg = TransformerConfig(num_layers=4, d_model=D, num_heads=2, d_ff=F, num_experts=4, moe_every=2)
    tokens = jnp.zeros((1, 8), jnp.int32)
    linen = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), tokens))["params"]
    assert [("router" in linen[f"layers_{i}"]["mlp"]) for i in range(4)] == [False, True, False, True]
    model = FunctionalModel(cfg)
    nnx_params = from_linen({"params": linen}, model.init(jax.random.key(1)))
    want = Transformer(cfg).apply({"params": linen}, tokens)
    _assert_close(model.apply(nnx_params, tokens), want, atol=1e-5)
    logits, sown = model.apply_with_intermediates(nnx_params, tokens)
    _, linen_sown = Transformer(cfg).apply({"params": linen}, tokens, mutable=["intermediates"])
    np.testing.assert_allclose(float(sown_aux_loss(sown)), float(sown_aux_loss(linen_sown)), rtol=1e-6)
    assert float(sown_aux_loss(sown)) > 1.0  # two layers' losses, each at least about 1


#: Shrinks the moe configs for tests (validation only at the end).
SMALL = ["model.d_model=32", "model.num_heads=2", "model.d_ff=32", "model.max_len=16", "data.seq_len=16",
         "data.batch_size=8", "data.max_bytes=100000", "train.eval_batches=1", "train.eval_every=1000",
         "train.log_every=1"]
ONE_DEVICE = {"mesh": {"data": 1}, "pipeline": None}


def small(name: str, out: Path, *overrides: str):
    return load_config(name, [*SMALL, f"train.out_dir={out}", *overrides])


def params_of(result) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(result.state["params"]))]


def _run(cfg, steps: int, **kw):
    result = train(cfg, quiet=True, **kw)
    return result, [result.losses[s] for s in range(result.start_step + 1, steps + 1)]


@pytest.mark.parametrize("name", ["moe", pytest.param("moe_pipeline", marks=pytest.mark.slow)])
def test_layout_trains_like_one_device_losses_and_parameters(name, tmp_path):
    """3 steps of the config (a pipeline: 2 stages of data=2 x expert=2) against the same config on one
    device: the train losses, the load-balancing losses and every parameter."""
    cfg = small(name, tmp_path / "run", "train.steps=3", "model.num_layers=2")
    one = cfg.replace(layout=ONE_DEVICE, train={"out_dir": str(tmp_path / "one")})
    got, got_losses = _run(cfg, 3)
    want, want_losses = _run(one, 3)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    _assert_close(params_of(got), params_of(want), rtol=1e-4, atol=1e-6)
    assert want_losses[-1] < want_losses[0]
    aux = [r["moe_aux_loss"] for r in _metrics(tmp_path / "run")]
    np.testing.assert_allclose(aux, [r["moe_aux_loss"] for r in _metrics(tmp_path / "one")], rtol=1e-5)
    assert all(1.0 <= a < 2 * cfg.model.num_layers for a in aux)  # two layers' losses, each at least 1
    wo = nn.meta.unbox(got.state["params"])["params"]["layers_0"]["mlp"]["wo"]
    assert wo.sharding.spec[0] == "expert" and {s.data.shape[0] for s in wo.addressable_shards} == {
        cfg.model.num_experts // cfg.layout.mesh["expert"]}


@pytest.mark.slow  # ~2 min: two trainings of the MoE model
def test_a_capacity_that_drops_nothing_trains_like_the_dropless_model_on_one_device(tmp_path):
    """moe (data=2 x expert=4 on 8 devices) with model.moe_capacity_factor=4 (num_experts / experts_per_token:
    every expert may take every token of a device's group) against the dropless model on one device, 3 steps:
    losses, load-balancing losses and every parameter."""
    cfg = small("moe", tmp_path / "cap", "train.steps=3", "model.num_layers=2", "model.moe_capacity_factor=4.0")
    one = small("moe", tmp_path / "one", "train.steps=3", "model.num_layers=2").replace(layout=ONE_DEVICE)
    got, got_losses = _run(cfg, 3)
    want, want_losses = _run(one, 3)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    _assert_close(params_of(got), params_of(want), rtol=1e-4, atol=1e-6)
    aux = [r["moe_aux_loss"] for r in _metrics(tmp_path / "cap")]
    np.testing.assert_allclose(aux, [r["moe_aux_loss"] for r in _metrics(tmp_path / "one")], rtol=1e-5)


def _metrics(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_nnx_model_with_experts_trains_like_one_device(tmp_path):
    """model.api=nnx on moe's data=2 x expert=4 (the NNX MoE layer sows inside nnx.capture; the same
    all-to-all) against the NNX model on one device: losses, load-balancing losses and parameters."""
    cfg = small("moe", tmp_path / "nnx", "train.steps=2", "model.num_layers=2", "model.api=nnx")
    result, got = _run(cfg, 2)
    one, want = _run(cfg.replace(layout=ONE_DEVICE, train={"out_dir": str(tmp_path / "one")}), 2)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _assert_close(params_of(result), params_of(one), rtol=1e-4, atol=1e-6)
    aux = [r["moe_aux_loss"] for r in _metrics(tmp_path / "nnx")]
    np.testing.assert_allclose(aux, [r["moe_aux_loss"] for r in _metrics(tmp_path / "one")], rtol=1e-5)


def test_pipeline_layout_trains_like_one_device(tmp_path):
    """moe_pipeline, 2 steps with 2 blocks (one per stage), each stage data=2 x expert=2."""
    cfg = small("moe_pipeline", tmp_path / "run", "train.steps=2", "model.num_layers=2",
                "layout.pipeline.microbatches=2")
    got, got_losses = _run(cfg, 2)
    want, want_losses = _run(cfg.replace(layout=ONE_DEVICE, train={"out_dir": str(tmp_path / "one")}), 2)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    _assert_close(params_of(got), params_of(want), rtol=1e-4, atol=1e-6)
    stages = {leaf.sharding.device_set.pop().id // 4 for key, leaf in
              jax.tree_util.tree_leaves_with_path(got.state["params"]) if "wo" in jax.tree_util.keystr(key)}
    assert stages == {0, 1}


@pytest.mark.slow  # ~3 min: four MoE programs, one a pipeline
def test_spmd_checkpoint_resumes_on_the_pipeline_and_on_another_expert_count(tmp_path):
    """Saved from moe (expert=4), restored onto moe_pipeline (2 stages, expert=2 each) and onto data=4 x
    expert=2: the restored values equal the saved ones, each device holding its share of the experts, and
    the continued steps equal the run that went on."""
    over = ("train.steps=4", "train.checkpoint_every=2", "model.num_layers=2")
    whole, whole_losses = _run(small("moe", tmp_path / "whole", *over), 4)
    train(small("moe", tmp_path / "cut", *over), quiet=True, stop_after=3)
    shutil.copytree(tmp_path / "cut", tmp_path / "cut2")
    with CheckpointManager(tmp_path / "cut" / "checkpoints") as mgr:
        saved = jax.device_get(mgr.restore(2, target=program_for(small("moe", tmp_path / "x", *over)).abstract_state)
                               .state)
    for name, out, extra in (("moe_pipeline", "cut", ("layout.pipeline.microbatches=2",)),
                             ("moe", "cut2", ("layout.mesh={data: 4, expert: 2}",))):
        cfg = small(name, tmp_path / out, *over, *extra)
        with CheckpointManager(tmp_path / out / "checkpoints") as mgr:
            restored = mgr.restore(2, target=program_for(cfg).abstract_state).state
        _assert_close(jax.device_get(restored), saved, rtol=0, atol=0)
        wi = nn.meta.unbox(restored["params"])["params"]["layers_1"]["mlp"]["wi_0"]
        assert {s.data.shape[0] for s in wi.addressable_shards} == {cfg.model.num_experts // 2}
        resumed, losses = _run(cfg, 4)
        assert resumed.start_step == 2
        np.testing.assert_allclose(losses, whole_losses[2:], rtol=1e-5, err_msg=name)
        _assert_close(params_of(resumed), params_of(whole), rtol=1e-4, atol=1e-6)
