"""`enable_recomputation`: a value made from constants alone is computed on each
submesh that reads it instead of being copied there. Measured: the bytes the plan and the runtime move.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multimesh.jax import enable_recomputation, ignore_transforms, parallelize, task

pytestmark = pytest.mark.devices(8)

S = 32  # sequence length: the mask is S x S float32 = 4 KiB


def problem():
    devs = jax.devices()
    attend = lambda x, w, mask: jnp.tanh((mask @ x) @ w)
    first = task(attend, "first", devices=devs[:4])
    second = task(attend, "second", devices=devs[4:])

    def step(params, batch):
        mask = jnp.tril(jnp.ones((S, S), jnp.float32)) / jnp.arange(1, S + 1, dtype=jnp.float32)[:, None]
        h = first(batch["x"], params["w1"], mask)
        return jnp.mean(second(h, params["w2"], mask) ** 2)

    def init():
        return {"w1": jnp.ones((8, 8)) / 8, "w2": jnp.eye(8)}

    def batch():
        return {"x": jnp.sin(jnp.arange(S * 8, dtype=jnp.float32)).reshape(S, 8)}

    return step, init, batch


def build(on: bool):
    step, init, batch = problem()
    grad_step = jax.value_and_grad(step)
    with enable_recomputation(on):
        fn, init_p, get_b = parallelize(grad_step, init_params=init, get_input_batch=batch)
    return fn, init_p(), get_b(), (grad_step, init(), batch())


def test_the_mask_is_recomputed_on_the_second_submesh_instead_of_copied():
    results = {}
    for on in (False, True):
        fn, params, b, (ref_step, ref_params, ref_b) = build(on)
        loss, grads = fn(params, b)
        with ignore_transforms():
            want_loss, want_grads = jax.jit(ref_step)(ref_params, ref_b)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        planned = sum(t[4] for t in fn.plan.transfers())
        results[on] = (planned, fn.stats.bytes_moved, fn.stats.transfers)
    mask_bytes = S * S * 4
    off, on = results[False], results[True]
    # the mask alone is what recomputation saves (both plans move the same activations otherwise)
    assert off[0] - on[0] == mask_bytes, results
    assert off[1] - on[1] == mask_bytes, results
    assert on[2] == off[2] - 1, results


def test_adam_scalars_are_computed_on_every_stage_from_one_copy_of_the_step_count():
    """Adam's per-step scalars come from its int32 count, a small step input: with recomputation each stage
    computes them from its own copy of the count (one 4-byte move a step, and each stage's update is one
    segment); without, they are computed on one stage (the count moved there) and sent to the other one by
    one. Both equal one
    device for 3 steps; the count, a scalar of the state, lives on the last stage with the others (its
    caller may combine them after the step)."""
    import optax
    from helpers import check_mpmd_against_reference

    devs = jax.devices()
    stages = [task(lambda w, x: jnp.tanh(x @ w), f"s{i}", devices=devs[4 * i:4 * i + 4]) for i in range(2)]
    tx = optax.adam(1e-2)

    def init():
        p = [jnp.eye(8) + 0.1 * i for i in range(2)]
        return {"p": p, "o": tx.init(p)}

    def batch():
        return {"x": jnp.sin(jnp.arange(64.0)).reshape(8, 8)}

    def step(state, b):
        def loss(p):
            h = b["x"]
            for s, w in zip(stages, p):
                h = s(w, h)
            return jnp.mean(h ** 2)

        value, grads = jax.value_and_grad(loss)(state["p"])
        updates, opt = tx.update(grads, state["o"], state["p"])
        return value, grads, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    scalars, glue = {}, {}  # per setting: scalars moved, segment labels
    for on in (False, True):
        with enable_recomputation(on):
            fn, state = check_mpmd_against_reference(step, init, batch)
        scalars[on] = [(aval.str_short(), "input" if src < 0 else fn.plan.segments[src].label)
                       for _, src, _, aval, _ in fn.plan.transfers() if aval.shape == ()]
        glue[on] = [s.label for s in fn.plan.segments]
        # the plan counts what the runtime moves, the count from the last stage included
        assert (len(fn.plan.transfers()), sum(t[4] for t in fn.plan.transfers())) == (
            fn.stats.transfers, fn.stats.bytes_moved)
        if on:
            count = state["o"][0].count
            assert count.sharding.device_set == set(devs[4:]) and int(count) == 3
    # the count, from the last stage to s0 where the bias corrections are computed; then both of them to s1
    assert scalars[False] == [("int32[]", "input")] + [("float32[]", "s0:bwd")] * 2, scalars
    assert scalars[True] == [("int32[]", "input")], scalars  # the count alone, from the step's input
    # without the scalars to wait for, stage 1's update joins its backward segment: one execution less
    assert glue[False] == ["s0:fwd", "s1:fwd+bwd", "s0:bwd", "s1:glue"], glue
    assert glue[True] == ["s0:fwd", "s1:fwd+bwd", "s0:bwd"], glue
