"""A short demo: the example transformer trained with `parallelize` on a 4x2 mesh.

Runs on 8 simulated CPU devices, prints the sharding report and the loss.
"""

from __future__ import annotations

import os
import time


def main(steps: int = 150) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import optax
    from tqdm import tqdm

    from models.transformer import Transformer, TransformerConfig, next_token_loss
    from multimesh.jax import parallelize, standard_rules
    from trainers.data import DataConfig, make_datasets

    cfg = TransformerConfig(num_layers=2, d_model=64, num_heads=4, max_len=64)
    train, val, baseline = make_datasets(DataConfig(seq_len=64, batch_size=16, max_bytes=1_000_000))
    model, tx = Transformer(cfg), optax.adamw(3e-3)
    mesh = {"data": 4, "tensor": 2}

    def init():
        params = model.init(jax.random.key(0), jax.numpy.zeros((1, 64), jax.numpy.int32))
        return {"params": params, "opt": tx.init(params)}

    def step(state, batch):
        def loss_fn(p):
            return next_token_loss(model.apply(p, batch["tokens"][:, :-1]), batch["tokens"])

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    first = train.batch_at(0)
    step_fn, init_fn = parallelize(step, init_params=init, initial_batch=first, mesh=mesh,
                                   rules=standard_rules(mesh), donate=True)
    print(step_fn.report())
    state = init_fn()
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc="train")
    for i in bar:
        loss, state = step_fn(state, train.batch_at(i))
        bar.set_postfix(loss=f"{float(loss):.3f}")
    print(f"{steps} steps in {time.perf_counter() - t0:.1f} s; final loss {float(loss):.3f} "
          f"(unigram baseline {baseline:.3f} nats)")
