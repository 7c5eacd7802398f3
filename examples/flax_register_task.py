"""MPMD without touching the model: an unmodified Flax transformer pipelined with `register_task`.

    python examples/flax_register_task.py

`models.transformer.Transformer` is a plain Linen model (submodules `embed`,
`layers_0` .. `layers_3`, `head`) that knows nothing of pipelines. A
registration turns the modules whose names match a regular expression into
tasks: a callback maps each match to a device range, here `embed` and the
first two blocks on devices 0-3 and the rest on devices 4-7, each a
`data=2 x tensor=2` submesh with the standard logical rules. `microbatch` runs
the batch as 4 microbatches under 1F1B. The result is checked against the same
step on one device.
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

from models.transformer import Transformer, TransformerConfig, next_token_loss
from multimesh.jax import ignore_transforms, microbatch, parallelize, register_task, standard_rules

CONFIG = TransformerConfig(num_layers=4, d_model=64, num_heads=4, max_len=32, tie_embeddings=False)
BATCH, LENGTH, MICROBATCH = 16, 32, 4
STAGE_DEVICES = 4  # each stage: data=2 x tensor=2

model, tx = Transformer(CONFIG), optax.adamw(3e-3)


def place(match, backprop):
    """Where a matched module runs: ``((first device, last device + 1), task name)``.

    Called for the forward (``backprop=False``) and the backward pass of each match;
    both go to the same stage here.
    """
    name = match.group(0)
    stage = 0 if name == "embed" else 1 if name == "head" else int(match.group(1)) * 2 // CONFIG.num_layers
    return (stage * STAGE_DEVICES, (stage + 1) * STAGE_DEVICES), f"stage{stage}"


def init_state():
    params = model.init(jax.random.key(0), jnp.zeros((1, LENGTH), jnp.int32))
    return {"params": params, "opt": tx.init(params)}


def get_batch():
    # Byte tokens of some text (real training data: see trainers/data.py).
    text = np.frombuffer((__doc__ * 4).encode(), np.uint8)[: BATCH * (LENGTH + 1)]
    return {"tokens": jnp.asarray(text.reshape(BATCH, LENGTH + 1), jnp.int32)}


def loss_fn(params, batch):
    logits = model.apply(params, batch["tokens"][:, :-1])
    # Summed and divided by the GLOBAL token count: microbatch sums over microbatches.
    return next_token_loss(logits, batch["tokens"], reduction="sum") / (BATCH * LENGTH)


def train_step(state, batch):
    pipelined = microbatch(loss_fn, 0, MICROBATCH, argnum=1, schedule="1f1b")
    loss, grads = jax.value_and_grad(pipelined)(state["params"], batch)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def main(steps: int = 2) -> None:
    axes = ("data", "tensor")
    # The registration holds while the step is traced (here: inside parallelize).
    with register_task(r"embed|head|layers_(\d+)", callback=place, dims=(2, 2), device_axes=axes,
                       logical_axes=standard_rules(axes)):
        step_fn, init_fn, batch_fn = parallelize(train_step, init_params=init_state, get_input_batch=get_batch)
    print(step_fn.plan.schedule)
    state, batch = init_fn(), batch_fn()

    # The parameter tree is the model's own; each block lives on its stage.
    params = nn.unbox(state["params"]["params"])
    for name in ("embed", "layers_1", "layers_2", "head"):
        leaf = jax.tree.leaves(params[name])[0]
        print(f"{name:9s} on devices {sorted(d.id for d in leaf.sharding.device_set)}")
    devices = jax.devices()
    assert jax.tree.leaves(params["layers_1"])[0].sharding.device_set == set(devices[:4])
    assert jax.tree.leaves(params["layers_2"])[0].sharding.device_set == set(devices[4:])
    assert params["layers_3"]["mlp"]["wi_0"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor")

    def one_device_step(state, batch):
        with ignore_transforms():
            return train_step(state, batch)

    reference = jax.jit(one_device_step)
    ref_state, ref_batch = jax.device_put((init_state(), get_batch()), devices[0])
    for i in range(steps):
        loss, state = step_fn(state, batch)
        ref_loss, ref_state = reference(ref_state, ref_batch)
        print(f"step {i}: loss {float(loss):.5f} (one device: {float(ref_loss):.5f})")
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    # Adam divides by the root of tiny second moments, so parameters agree less tightly than losses.
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    print(f"{steps} pipelined steps of the unmodified model equal the one-device run")


if __name__ == "__main__":
    main()
