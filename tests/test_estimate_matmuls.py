"""The matrix products' flops counted from the traced program: every product, a loop's body once per trip,
where XLA's analysis of the compiled program counts a `scan` body once."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.estimate.matmuls import matmul_flops
from multimesh.jax import build_mesh, parallelize

L, B, D = 4, 32, 64


def scanned(w, x):
    def body(h, wi):
        return jnp.tanh(h @ wi), None

    h, _ = jax.lax.scan(body, x, w)
    return jnp.sum(h)


def test_products_loops_and_branches_are_counted_from_their_shapes():
    one = 2 * B * D * D
    jaxpr = jax.make_jaxpr(scanned)(jnp.zeros((L, D, D)), jnp.zeros((B, D)))
    assert matmul_flops(jaxpr) == L * one
    grad = jax.make_jaxpr(jax.grad(scanned))(jnp.zeros((L, D, D)), jnp.zeros((B, D)))
    assert matmul_flops(grad) == 3 * L * one  # forward, and the two products of each one's gradient
    branchy = jax.make_jaxpr(lambda p, a: jax.lax.cond(p, lambda: a @ a @ a, lambda: a @ a))(True, jnp.zeros((D, D)))
    assert matmul_flops(branchy) == 2 * (2 * D * D * D)
    batched = jax.make_jaxpr(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))(jnp.zeros((3, 5, 7)), jnp.zeros((3, 7, 2)))
    assert matmul_flops(batched) == 2 * 3 * 5 * 2 * 7


def test_a_grouped_product_counts_each_row_through_its_own_group_only():
    """``ragged_dot`` (a Mixture of Experts' experts): M rows, each through one of G groups' [K, N] matrices,
    is 2 M K N flops, and so is each of its two gradients (the weights' one contracts the ragged rows into one
    block per group), not G times that."""
    m, k, n, g = 64, 32, 16, 8
    sizes = jnp.array([8, 0, 16, 8, 8, 8, 8, 8], jnp.int32)  # uneven groups, one empty: the count is the same

    def grouped(x, w):
        return jnp.sum(jax.lax.ragged_dot(x, w, sizes) ** 2)

    x, w = jnp.zeros((m, k)), jnp.zeros((g, k, n))
    assert matmul_flops(jax.make_jaxpr(grouped)(x, w)) == 2 * m * k * n
    assert matmul_flops(jax.make_jaxpr(jax.grad(grouped, argnums=(0, 1)))(x, w)) == 3 * (2 * m * k * n)


@pytest.mark.devices(8)
def test_a_scanned_step_counts_every_layers_products_per_device():
    def init():
        return {"w": jax.random.normal(jax.random.key(0), (L, D, D)) * 0.1}

    def step(params, batch):
        value, grads = jax.value_and_grad(scanned)(params["w"], batch["x"])
        return value, {"w": params["w"] - 0.1 * grads}

    fn, _, _ = parallelize(step, init_params=init, get_input_batch=lambda: {"x": jnp.ones((B, D))},
                           mesh=build_mesh({"data": 8}), rules=[("batch", "data")],
                           param_rules=[(r"w$", P())])
    assert isinstance(fn.batch_shardings["x"], NamedSharding)
    (program,) = fn.estimate().programs
    assert program.flops >= 3 * L * 2 * B * D * D / 8  # every layer's forward and backward products
