"""SPMD: a Flax model's one-device training step, run sharded over a 4x2 mesh with `parallelize`.

    python examples/spmd_flax.py

The model names the logical axes of its parameters and activations; the rules
map them to mesh axes (`batch` over `data`, the hidden `mlp` dimension over
`model`: data x tensor parallelism). The step is written for one device and
runs unchanged. At the end, the sharded run is checked against the same step
jitted on one device.
"""

import os

# 8 simulated CPU devices (must be set before JAX starts; harmless on GPU).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from multimesh.jax import parallelize, with_sharding_constraint

BATCH, FEATURES, HIDDEN, CLASSES = 64, 32, 256, 10


class Classifier(nn.Module):
    """A two-layer MLP whose parameters carry logical axis names."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(HIDDEN, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        # Activations can be named too; on one device this is a no-op.
        h = with_sharding_constraint(nn.gelu(h), P("batch", "mlp"))
        return nn.Dense(CLASSES, kernel_init=nn.with_logical_partitioning(init, ("mlp", "vocab")))(h)


model, tx = Classifier(), optax.adamw(1e-2)


def init_state():
    """Zero-argument initializer: parallelize evaluates it abstractly, then creates it sharded."""
    params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))
    return {"params": params, "opt": tx.init(params)}


def get_batch():
    x = jax.random.normal(jax.random.key(1), (BATCH, FEATURES))
    labels = jnp.argmax(x[:, :CLASSES], axis=-1)  # a learnable rule: the largest of the first 10 features
    return {"x": x, "labels": labels}


def train_step(state, batch):
    """One optimizer step, written for one device."""

    def loss_fn(params):
        logits = model.apply(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def main(steps: int = 5) -> None:
    step_fn, init_fn, batch_fn = parallelize(
        train_step, init_params=init_state, get_input_batch=get_batch,
        mesh={"data": 4, "model": 2},
        rules=[("batch", "data"), ("mlp", "model")],  # embed and vocab: replicated
        donate=True,  # the old state's buffers are reused for the new state
    )
    state, batch = init_fn(), batch_fn()  # born sharded: never whole on one device
    print(step_fn.report())  # path, shape, logical spec, PartitionSpec, bytes per device

    kernel = nn.unbox(state["params"]["params"]["Dense_0"]["kernel"])
    print(f"Dense_0/kernel: {kernel.sharding.spec}, each device holds {kernel.addressable_shards[0].data.shape}")
    assert kernel.sharding.spec == P(None, "model")
    assert kernel.addressable_shards[0].data.shape == (FEATURES, HIDDEN // 2)
    assert batch["x"].sharding.spec == P("data")

    # The reference: the same step, jitted on one device, from the same initial state.
    reference = jax.jit(train_step)
    ref_state, ref_batch = jax.device_put((init_state(), get_batch()), jax.devices()[0])

    for i in range(steps):
        loss, state = step_fn(state, batch)
        ref_loss, ref_state = reference(ref_state, ref_batch)
        print(f"step {i}: loss {float(loss):.4f} (one device: {float(ref_loss):.4f})")
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)

    # The new state keeps the parameters' shardings, so it feeds straight back in.
    assert nn.unbox(state["params"]["params"]["Dense_0"]["kernel"]).sharding.spec == P(None, "model")
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    print(f"{steps} sharded steps equal the one-device run")


if __name__ == "__main__":
    main()
