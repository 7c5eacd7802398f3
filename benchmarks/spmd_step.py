"""Step time of `parallelize` against a hand-written `jax.jit` with the same shardings.

Both run the same 2-layer MLP train step (adamw) on a 4x2 (data x model) mesh
of simulated CPU devices, in one process, interleaved, best of several rounds.

    python benchmarks/spmd_step.py [--steps 50] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from multimesh.jax import build_mesh, parallelize  # noqa: E402
from multimesh.jax.flax import shard_axes  # noqa: E402


class MLP(nn.Module):
    hidden: int = 1024

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.hidden, kernel_init=shard_axes("embed", "mlp"))(x))
        return nn.Dense(x.shape[-1], kernel_init=shard_axes("mlp", "embed"))(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()

    model, tx = MLP(), optax.adamw(1e-3)
    x0 = jnp.zeros((args.batch, args.width))

    def init():
        params = model.init(jax.random.key(0), x0)
        return {"params": params, "opt": tx.init(params)}

    def get_batch():
        return {"x": jax.random.normal(jax.random.key(1), (args.batch, args.width)),
                "y": jax.random.normal(jax.random.key(2), (args.batch, args.width))}

    def step(state, batch):
        def loss_fn(p):
            return jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    mesh = build_mesh({"data": 4, "model": 2})
    sharded, init_p, get_b = parallelize(step, init_params=init, get_input_batch=get_batch, mesh=mesh,
                                         rules=[("batch", "data"), ("mlp", "model")], donate=True)
    # The hand-written alternative: the same shardings, given to jax.jit directly.
    ps, bs = sharded.param_shardings, sharded.batch_shardings
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    hand = jax.jit(step, in_shardings=(ps, bs), out_shardings=(replicated, ps), donate_argnums=(0,))
    hand_init = jax.jit(init, out_shardings=ps)

    def timed(fn, state, batch) -> tuple[float, object]:
        loss, state = fn(state, batch)  # warm (compiled already after the first round)
        jax.block_until_ready(state)
        t = time.perf_counter()
        for i in range(args.steps):
            loss, state = fn(state, batch)
            if i % 10 == 9:
                jax.block_until_ready(loss)
        jax.block_until_ready(state)
        return (time.perf_counter() - t) / args.steps, state

    batch = get_b()
    s_mm, s_hand = init_p(), hand_init()
    best_mm = best_hand = float("inf")
    for _ in range(args.rounds):
        t, s_mm = timed(sharded, s_mm, batch)
        best_mm = min(best_mm, t)
        t, s_hand = timed(hand, s_hand, batch)
        best_hand = min(best_hand, t)
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, mesh {dict(mesh.shape)}")
    print(f"parallelize step: {best_mm * 1e3:.3f} ms   hand-written jax.jit: {best_hand * 1e3:.3f} ms   "
          f"ratio {best_mm / best_hand:.3f}")


if __name__ == "__main__":
    main()
