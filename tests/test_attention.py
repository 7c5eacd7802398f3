"""The models' attention (jax.nn.dot_product_attention) against the einsum attention they used before:
outputs and gradients, float32 and bfloat16, multi-head and grouped-query, in the function and in both
whole models; and the planner still finding the attention score matrices in the compiled program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import nnx_transformer, transformer
from models.attention import causal_attention, pick_implementation
from models.transformer import Transformer, TransformerConfig, next_token_loss


def einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str = "auto") -> jax.Array:
    """The reference: scores materialised in float32 by einsum, a causal mask, softmax, probabilities in the
    inputs' dtype (query head j*g + i attends with key/value head j)."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)


TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def _qkv(dtype: str, heads: int, kv_heads: int) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(2, 16, heads, 8), (2, 16, kv_heads, 8), (2, 16, kv_heads, 8)]
    return tuple(jax.random.normal(kk, s, jnp.float32).astype(dtype) for kk, s in zip(keys, shapes, strict=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_outputs_and_gradients_equal_einsum_attention(dtype: str, heads: int, kv_heads: int) -> None:
    q, k, v = _qkv(dtype, heads, kv_heads)
    cot = jax.random.normal(jax.random.key(1), q.shape, jnp.float32).astype(dtype)

    def loss(f, q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * cot.astype(jnp.float32))

    out, ref = jax.jit(causal_attention)(q, k, v), jax.jit(einsum_attention)(q, k, v)
    assert out.dtype == ref.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=TOL[dtype],
                               rtol=TOL[dtype])
    grads = jax.jit(jax.grad(lambda *a: loss(causal_attention, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: loss(einsum_attention, *a), argnums=(0, 1, 2)))(q, k, v)
    for name, g, w in zip("qkv", grads, want, strict=True):
        scale = float(np.max(np.abs(np.asarray(w, np.float32))))
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=TOL[dtype] * scale, rtol=TOL[dtype], err_msg=f"d{name}")


def test_attention_is_causal() -> None:
    q, k, v = _qkv("float32", 4, 2)
    changed = v.at[:, 10:].set(100.0)  # the values of later positions do not reach earlier ones
    run = jax.jit(causal_attention)
    np.testing.assert_array_equal(np.asarray(run(q, k, v)[:, :10]), np.asarray(run(q, k, changed)[:, :10]))


def test_implementation_choice() -> None:
    q, k, _ = _qkv("bfloat16", 4, 2)
    assert pick_implementation("xla", q, k) == "xla"
    assert pick_implementation("cudnn", q, k) == "cudnn"
    assert pick_implementation("auto", q, k) == ("cudnn" if jax.default_backend() == "gpu" else None)
    assert pick_implementation("auto", q.astype(jnp.float32), k.astype(jnp.float32)) is None  # cuDNN: 16-bit
    with pytest.raises(ValueError, match=r"'flash'.*'auto', 'xla', 'cudnn'"):
        pick_implementation("flash", q, k)
    with pytest.raises(ValueError, match=r"attention='flash'"):
        TransformerConfig(attention="flash")


def _loss_and_grads(config: TransformerConfig, api: str) -> tuple[jax.Array, jax.Array, object]:
    tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, config.vocab_size)
    if api == "linen":
        model = Transformer(config)
        params = model.init(jax.random.key(0), tokens[:, :-1])
        apply = model.apply
    else:
        model = nnx_transformer.FunctionalModel(config)
        params = model.init(jax.random.key(0))
        apply = model.apply

    def loss(p):
        logits = apply(p, tokens[:, :-1])
        return next_token_loss(logits, tokens), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, value, grads


@pytest.mark.parametrize("api,dtype", [("linen", "float32"), ("nnx", "bfloat16"),
                                       pytest.param("linen", "bfloat16", marks=pytest.mark.slow),
                                       pytest.param("nnx", "float32", marks=pytest.mark.slow)])
def test_models_equal_their_einsum_attention(api: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = TransformerConfig(d_model=32, num_heads=4, num_kv_heads=2, dtype=dtype, api=api)
    logits, loss, grads = _loss_and_grads(config, api)
    module = transformer if api == "linen" else nnx_transformer
    monkeypatch.setattr(module, "causal_attention", einsum_attention)
    ref_logits, ref_loss, ref_grads = _loss_and_grads(config, api)
    tol = TOL[dtype] * (5 if dtype == "bfloat16" else 1)  # bfloat16 errors compound over two blocks
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=tol, rtol=tol)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=tol)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
        scale = float(np.max(np.abs(np.asarray(w))))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tol * scale, rtol=tol,
                                   err_msg=jax.tree_util.keystr(path))


def test_planner_finds_the_attention_scores() -> None:
    """XLA on CPU lowers dot_product_attention to products around a softmax: the planner's kernels see its
    score matrices (what a flash kernel keeps on chip) as they saw the einsum attention's."""
    from multimesh.estimate.kernels import find_kernels

    q, k, v = _qkv("float32", 4, 2)
    q, k, v = (jnp.tile(x, (1, 4, 1, 1)) for x in (q, k, v))  # 64 positions: scores larger than q, k, v

    def score_bytes(f) -> int:
        step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)))
        return sum(kk.attention_bytes * kk.count for kk in find_kernels(step.lower(q, k, v).compile().as_text()))

    scores = 2 * 64 * 64 * 4 * 4  # one float32 score matrix [b, heads, t, t]
    new, old = score_bytes(causal_attention), score_bytes(einsum_attention)
    assert new >= 2 * scores and old >= 2 * scores  # written and read at least once, forward and backward
    assert 0.5 <= new / old <= 2.0, (new, old)

