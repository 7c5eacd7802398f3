"""The example models: shapes, causality, GQA, tying, logical metadata, precision, staging."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from models import (
    Block,
    Embed,
    Head,
    Transformer,
    TransformerConfig,
    count_params,
    cross_entropy,
    init_params,
    logical_specs,
    next_token_loss,
)

TINY = TransformerConfig(vocab_size=256, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                         d_ff=64, max_len=16)
B, T = 2, 16
LOGICAL_NAMES = {"vocab", "embed", "heads", "kv_heads", "kv", "mlp", "norm"}


def _tokens(seed: int = 0, shape: tuple[int, int] = (B, T)) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, 256, dtype=jnp.int32)


@pytest.fixture(scope="module")
def tiny():
    """(model, variables, jitted apply) for the tiny GQA config."""
    model = Transformer(TINY)
    variables = jax.jit(lambda: init_params(TINY, jax.random.key(0), B, T))()
    return model, variables, jax.jit(model.apply)


def _boxes(tree):
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def test_shapes_and_dtypes(tiny):
    model, variables, apply = tiny
    logits = apply(variables, _tokens())
    assert logits.shape == (B, T, TINY.vocab_size)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    for leaf in jax.tree_util.tree_leaves(nn.meta.unbox(variables)):
        assert leaf.dtype == jnp.float32
    shapes = jax.tree_util.tree_map(lambda x: x.shape, nn.meta.unbox(variables))["params"]
    assert set(shapes) == {"embed", "layers_0", "layers_1", "head"}
    attn = shapes["layers_0"]["attn"]
    assert attn["query"]["kernel"] == (32, 4, 8)
    assert attn["key"]["kernel"] == (32, 2, 8)
    assert attn["value"]["kernel"] == (32, 2, 8)
    assert attn["out"]["kernel"] == (4, 8, 32)
    assert shapes["layers_0"]["mlp"]["wi_0"]["kernel"] == (32, 64)
    assert shapes["layers_0"]["mlp"]["wo"]["kernel"] == (64, 32)


def test_initial_loss_near_uniform(tiny):
    _, variables, apply = tiny
    tokens = _tokens(1, (B, T + 1))
    loss = float(next_token_loss(apply(variables, tokens[:, :-1]), tokens))
    assert abs(loss - math.log(256)) < 1.0


def test_causal_masking(tiny):
    _, variables, apply = tiny
    tokens = _tokens()
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    a, b = apply(variables, tokens), apply(variables, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :10]), np.asarray(b[:, :10]))
    assert not np.allclose(np.asarray(a[:, 10:]), np.asarray(b[:, 10:]))


def test_gqa_equals_mha_with_shared_kv(tiny):
    """GQA with 2 kv heads == MHA whose 4 kv heads repeat each GQA kv head twice."""
    _, variables, apply = tiny
    mha_cfg = TransformerConfig(**{**TINY.to_dict(), "num_kv_heads": 4})
    params = jax.tree_util.tree_map(lambda x: x, nn.meta.unbox(variables))["params"]
    for i in range(TINY.num_layers):
        attn = params[f"layers_{i}"]["attn"]
        for name in ("key", "value"):
            attn[name] = {"kernel": jnp.repeat(attn[name]["kernel"], 2, axis=1)}
    mha = jax.jit(Transformer(mha_cfg).apply)({"params": params}, _tokens())
    np.testing.assert_allclose(np.asarray(mha), np.asarray(apply(variables, _tokens())), atol=1e-5, rtol=1e-5)


def test_tied_vs_untied_param_counts():
    tied = jax.eval_shape(lambda: init_params(TINY, jax.random.key(0)))
    untied_cfg = TransformerConfig(**{**TINY.to_dict(), "tie_embeddings": False})
    untied = jax.eval_shape(lambda: init_params(untied_cfg, jax.random.key(0)))
    assert count_params(untied) - count_params(tied) == TINY.d_model * TINY.vocab_size
    assert "output" not in tied["params"]["head"]
    assert nn.get_partition_spec(untied)["params"]["head"]["output"]["kernel"] == P("embed", "vocab")


@pytest.mark.parametrize("tie", [True, False])
def test_every_parameter_has_logical_names(tie):
    cfg = TransformerConfig(**{**TINY.to_dict(), "tie_embeddings": tie})
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    leaves = _boxes(abstract)
    assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
    for box in leaves:
        assert len(box.names) == box.value.ndim
        assert set(box.names) <= LOGICAL_NAMES, box.names
    specs = logical_specs(cfg)["params"]
    assert specs["embed"]["embedding"] == P("vocab", "embed")
    attn = specs["layers_1"]["attn"]
    assert attn["query"]["kernel"] == P("embed", "heads", "kv")
    assert attn["key"]["kernel"] == P("embed", "kv_heads", "kv")
    assert attn["out"]["kernel"] == P("heads", "kv", "embed")
    assert specs["layers_1"]["mlp"]["wi_1"]["kernel"] == P("embed", "mlp")
    assert specs["layers_1"]["mlp"]["wo"]["kernel"] == P("mlp", "embed")
    assert specs["layers_1"]["attn_norm"]["scale"] == P("norm")
    assert specs["head"]["final_norm"]["scale"] == P("norm")


def test_bf16_compute_float32_logits(tiny):
    _, variables, apply = tiny
    cfg = TransformerConfig(**{**TINY.to_dict(), "dtype": "bfloat16"})
    bf16_vars = jax.jit(lambda: init_params(cfg, jax.random.key(0), B, T))()
    for leaf in jax.tree_util.tree_leaves(nn.meta.unbox(bf16_vars)):
        assert leaf.dtype == jnp.float32  # params stay float32
    logits = jax.jit(Transformer(cfg).apply)(variables, _tokens())
    assert logits.dtype == jnp.float32
    ref = apply(variables, _tokens())
    assert float(jnp.max(jnp.abs(logits - ref))) < 0.25  # same model, bf16 rounding only


def test_staged_call_equals_full_call(tiny):
    model, variables, apply = tiny
    tokens = _tokens()

    @jax.jit
    def staged(v, tok):
        x = model.apply(v, tok, method=Transformer.embed_tokens)
        x = model.apply(v, x, 0, 1, method=Transformer.run_blocks)
        x = model.apply(v, x, 1, 2, method=Transformer.run_blocks)
        return model.apply(v, x, method=Transformer.compute_logits)

    @jax.jit
    def modules(v, tok):
        p = nn.meta.unbox(v)["params"]
        x = Embed(TINY).apply({"params": p["embed"]}, tok)
        for i in range(TINY.num_layers):
            x = Block(TINY).apply({"params": p[f"layers_{i}"]}, x)
        return Head(TINY).apply({"params": p["head"]}, x, p["embed"]["embedding"])

    full = np.asarray(apply(variables, tokens))
    np.testing.assert_allclose(np.asarray(staged(variables, tokens)), full, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(modules(variables, tokens)), full, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError):
        model.apply(variables, jnp.zeros((1, 4, 32)), 1, 3, method=Transformer.run_blocks)


def test_remat_same_logits_and_params(tiny):
    _, variables, apply = tiny
    cfg = TransformerConfig(**{**TINY.to_dict(), "remat": True})
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(variables)
    logits = jax.jit(Transformer(cfg).apply)(variables, _tokens())
    np.testing.assert_allclose(np.asarray(logits), np.asarray(apply(variables, _tokens())), atol=1e-6)


def test_learns_a_fixed_batch(tiny):
    model, variables, _ = tiny
    params = nn.meta.unbox(variables)
    tokens = _tokens(3, (B, T + 1))
    opt = optax.adam(3e-3)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(lambda p: next_token_loss(model.apply(p, tokens[:, :-1]), tokens))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = opt.init(params)
    losses = []
    for _ in range(30):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]


def test_losses():
    v = 8
    tokens = jnp.ones((2, 6), jnp.int32)
    mask = jnp.ones((2, 5)).at[0, 0].set(0.0)

    @jax.jit
    def all_losses(logits, peaked):
        return (
            next_token_loss(logits, tokens),
            next_token_loss(logits, tokens[:, :5]),  # inputs-only form: 4 scored positions
            next_token_loss(logits, tokens, reduction="sum"),
            next_token_loss(peaked, tokens, mask),  # the perfectly predicted position is masked
            cross_entropy(peaked[0, 0], tokens[0, 1]),
            next_token_loss(peaked.astype(jnp.bfloat16), tokens),
        )

    logits = jnp.zeros((2, 5, v))
    mean, mean_inputs, total, masked, perfect, bf16 = all_losses(logits, logits.at[0, 0, 1].set(100.0))
    assert float(mean) == pytest.approx(math.log(v), rel=1e-6)
    assert float(mean_inputs) == pytest.approx(math.log(v), rel=1e-6)
    assert float(total) == pytest.approx(10 * math.log(v), rel=1e-6)
    assert float(masked) == pytest.approx(math.log(v), rel=1e-6)
    assert float(perfect) == pytest.approx(0.0, abs=1e-6)
    assert bf16.dtype == jnp.float32
    with pytest.raises(ValueError):
        next_token_loss(logits, np.ones((2, 3), np.int32))
    with pytest.raises(ValueError):
        next_token_loss(logits, tokens, reduction="max")


def test_config_validation():
    assert TransformerConfig(d_model=64, num_heads=4).head_dim == 16
    assert TransformerConfig(num_heads=4).num_kv_heads == 4
    assert TransformerConfig.from_dict({"num_layers": 3}).num_layers == 3
    with pytest.raises(ValueError):
        TransformerConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError):
        TransformerConfig.from_dict({"layers": 3})
    with pytest.raises(ValueError):
        Transformer(TINY).init(jax.random.key(0), jnp.zeros((1, TINY.max_len + 1), jnp.int32))
