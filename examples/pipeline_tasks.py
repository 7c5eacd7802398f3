"""MPMD: a two-stage pipeline built from `task`s, trained with 4 microbatches under 1F1B.

    python examples/pipeline_tasks.py

Each stage is a plain function marked as a `task` on its own 2x2 submesh of the
8 devices (sliced from one 2x2x2 mesh along `stage`). Inside a stage, the
batch is split over `data` and the hidden dimension over `model`. multimesh
cuts the step into per-stage programs, moves activations and gradients between
the submeshes, and runs the microbatches in the schedule's order. The result is
checked against the same step on one device (`ignore_transforms`).
"""

import os

# 8 simulated CPU devices (must be set before JAX starts; harmless on GPU).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from multimesh.jax import build_mesh, ignore_transforms, microbatch, parallelize, slice_mesh, task
from multimesh.jax import with_sharding_constraint as constrain

BATCH, WIDTH, HIDDEN, MICROBATCH = 32, 16, 64, 8
RULES = [("batch", "data"), ("hidden", "model")]  # each stage's logical axis rules


def block(w, x):
    """A residual MLP block; `hidden` is sharded over the stage's `model` axis."""
    h = constrain(jnp.tanh(x @ w["up"]), P("batch", "hidden"))
    return x + h @ w["down"]


def stage(w, x):
    """Two blocks: the work of one pipeline stage."""
    return block(w[1], block(w[0], x))


first_mesh, second_mesh = slice_mesh(build_mesh({"stage": 2, "data": 2, "model": 2}), "stage")
first = task(stage, "first", mesh=first_mesh, logical_axes=RULES)  # devices 0-3
second = task(stage, "second", mesh=second_mesh, logical_axes=RULES)  # devices 4-7
tx = optax.adam(1e-2)


def init_state():
    keys = iter(jax.random.split(jax.random.key(0), 8))

    def new_block():
        return {"up": jax.random.normal(next(keys), (WIDTH, HIDDEN)) * 0.2,
                "down": jax.random.normal(next(keys), (HIDDEN, WIDTH)) * 0.2}

    params = {"first": [new_block(), new_block()], "second": [new_block(), new_block()]}
    return {"params": params, "opt": tx.init(params)}


def get_batch():
    x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
    return {"x": x, "y": jnp.roll(x, 1, axis=-1)}  # learn to rotate the features


def loss_fn(params, batch):
    out = second(params["second"], first(params["first"], batch["x"]))
    # Divided by the GLOBAL batch size: microbatch sums the microbatches' losses.
    return jnp.sum((out - batch["y"]) ** 2) / (BATCH * WIDTH)


def train_step(state, batch):
    pipelined = microbatch(loss_fn, 0, MICROBATCH, argnum=1, schedule="1f1b")  # 4 microbatches of 8
    loss, grads = jax.value_and_grad(pipelined)(state["params"], batch)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def main(steps: int = 3) -> None:
    step_fn, init_fn, batch_fn = parallelize(
        train_step, init_params=init_state, get_input_batch=get_batch,
        # Plain arrays carry no logical names: name them by path (a tuple of logical names,
        # resolved by the rules of the stage that uses the parameter).
        param_rules={r"/up$": (None, "hidden"), r"/down$": ("hidden", None)},
    )
    print(step_fn.plan)  # the segments, their submeshes, the transfers and the schedule's timeline
    state, batch = init_fn(), batch_fn()

    # Parameters are born on their stage's submesh, sharded by its rules.
    up0, up3 = state["params"]["first"][0]["up"], state["params"]["second"][1]["up"]
    assert up0.sharding.device_set == set(first_mesh.devices.flat)
    assert up3.sharding.device_set == set(second_mesh.devices.flat)
    assert up3.sharding.spec == P(None, "model")

    def one_device_step(state, batch):
        with ignore_transforms():  # tasks and microbatching off: the plain program
            return train_step(state, batch)

    reference = jax.jit(one_device_step)
    ref_state, ref_batch = jax.device_put((init_state(), get_batch()), jax.devices()[0])
    for i in range(steps):
        loss, state = step_fn(state, batch)
        ref_loss, ref_state = reference(ref_state, ref_batch)
        print(f"step {i}: loss {float(loss):.5f} (one device: {float(ref_loss):.5f})")
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)

    stats = step_fn.stats  # what the last call did
    print(f"executed: {' '.join(label for label in stats.executed if ':F[' in label or ':B[' in label)}")
    print(f"peak live activations per stage: {stats.peak_live_activations} (1F1B bound: min(stages - s, microbatches))")
    assert stats.peak_live_activations == {0: 2, 1: 1}
    print(f"{steps} pipelined steps equal the one-device run")


if __name__ == "__main__":
    main()
