"""Checkpoints: save sharded training state on one layout, restore it onto others and keep training.

    python examples/checkpoint_relayout.py [CHECKPOINT_DIR]

A small transformer trains for 3 steps with data x tensor parallelism on 8
devices (`data=4 x tensor=2`) and is saved with `CheckpointManager` (each
device writes its own shards, asynchronously). The checkpoint is then restored
onto two other layouts, FSDP over 8 devices and a single device, by passing
the new step function as the restore target: its `abstract_params` say where
every array must go. Each restored run continues for 2 steps and matches the
run that was never interrupted.
"""

import os
import sys
import tempfile

# 8 simulated CPU devices (must be set before JAX starts; harmless on GPU).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from models.transformer import Transformer, TransformerConfig, next_token_loss
from multimesh.checkpoint import CheckpointManager
from multimesh.jax import parallelize, standard_rules

CONFIG = TransformerConfig(num_layers=2, d_model=64, num_heads=4, max_len=32)
BATCH, LENGTH = 16, 32
model, tx = Transformer(CONFIG), optax.adamw(3e-3)


def init_state():
    params = model.init(jax.random.key(0), jnp.zeros((1, LENGTH), jnp.int32))
    return {"params": params, "opt": tx.init(params)}


def get_batch():
    text = np.frombuffer((__doc__ * 4).encode(), np.uint8)[: BATCH * (LENGTH + 1)]
    return {"tokens": jnp.asarray(text.reshape(BATCH, LENGTH + 1), jnp.int32)}


def train_step(state, batch):
    def loss_fn(params):
        return next_token_loss(model.apply(params, batch["tokens"][:, :-1]), batch["tokens"])

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def on_layout(mesh: dict, devices: list) -> tuple:
    """The step, initializer and batch of one layout (the standard rules of its mesh axes)."""
    return parallelize(train_step, init_params=init_state, get_input_batch=get_batch, devices=devices,
                       mesh=mesh, rules=standard_rules(mesh), donate=True)


def embedding_layout(state) -> str:
    table = nn.unbox(state["params"]["params"]["embed"]["embedding"])
    return f"{table.sharding.spec} over {len(table.sharding.device_set)} device(s), shard {table.addressable_shards[0].data.shape}"


def main(directory: str) -> None:
    devices = jax.devices()
    step_fn, init_fn, batch_fn = on_layout({"data": 4, "tensor": 2}, devices[:8])
    state, batch = init_fn(), batch_fn()
    with CheckpointManager(directory) as mgr:
        for _ in range(3):
            _, state = step_fn(state, batch)
        # Returns once the shards are copied to host memory; the files are written in the background.
        mgr.save(3, state, data_position={"step": 3}, metadata={"layout": "data=4 x tensor=2"})
        print(f"saved step 3 to {mgr.step_path(3)}; embedding {embedding_layout(state)}")
        saved = jax.device_get(state)  # host copies, to compare with what comes back
        want = []  # the run that is never interrupted: steps 4 and 5
        for _ in range(2):
            loss, state = step_fn(state, batch)
            want.append(float(loss))

    for mesh, devs in [({"fsdp": 8}, devices[:8]), ({"data": 1}, devices[:1])]:
        new_step, _, new_batch = on_layout(mesh, devs)
        with CheckpointManager(directory) as mgr:
            restored = mgr.restore(target=new_step)  # the latest step, laid out as new_step wants it
        state = restored.state
        assert nn.unbox(state["params"]["params"]["embed"]["embedding"]).sharding.device_set == set(devs)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(saved)):
            np.testing.assert_array_equal(np.asarray(a), b)  # bit for bit
        print(f"restored step {restored.step} (saved on {restored.metadata['layout']}) onto {mesh}: "
              f"embedding {embedding_layout(state)}")
        got, batch = [], new_batch()
        for _ in range(2):
            loss, state = new_step(state, batch)
            got.append(float(loss))
        print(f"  steps 4-5: loss {got[0]:.5f}, {got[1]:.5f} (uninterrupted: {want[0]:.5f}, {want[1]:.5f})")
        np.testing.assert_allclose(got, want, rtol=1e-5)
    print("restored runs continue exactly as the uninterrupted one")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(os.path.join(tmp, "checkpoints"))
