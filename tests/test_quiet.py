"""No stray output: what a user did not ask to see is not printed or logged.

Each test captures the channel the noise used to appear on (a log record, a
line on stdout, a warning) and asserts that nothing comes.
"""

from __future__ import annotations

import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multimesh.checkpoint import CheckpointManager, abstract_target
from multimesh.jax import StepInputError, build_mesh, microbatch, parallelize, task

pytestmark = pytest.mark.devices(8)


def test_read_only_manager_and_restore_log_nothing(tmp_path, caplog):
    """Orbax warned three times per read-only manager (options it resets, "directory is read only")."""
    state = {"w": jax.device_put(np.arange(8.0, dtype=np.float32))}
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, state)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    caplog.clear()
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            with CheckpointManager(tmp_path / "c", read_only=True) as mgr:
                restored = mgr.restore(target=abstract_target(jax.eval_shape(lambda: state), one))
                assert mgr.all_steps() == [1]
    assert np.array_equal(np.asarray(restored.state["w"]), np.arange(8.0))
    noisy = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert noisy == []


def test_an_indivisible_batch_prints_nothing_before_its_error(capfd):
    """JAX's device_put printed the calling source line (``checks.py:...(place_batch.<locals>.<lambda>)``)
    to stdout before raising; the batch is checked before it gets there."""
    def step(params, batch):
        return jnp.sum(params["w"]) * jnp.sum(batch["x"]), params

    fn, init, _ = parallelize(step, init_params=lambda: {"w": jnp.ones(4)},
                              get_input_batch=lambda: {"x": jnp.ones((8, 4))},
                              mesh={"data": 8}, rules=[("batch", "data")])
    params = init()
    capfd.readouterr()
    with pytest.raises(StepInputError, match=r"batch leaf 'x' of step 'step' has shape \(6, 4\) .*does not divide"):
        fn(params, {"x": np.ones((6, 4), np.float32)})
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_a_pipeline_build_and_first_call_warn_nothing_about_jaxprs():
    """JAX deprecates jaxprs built without a DebugInfo ("core.Jaxpr is missing a DebugInfo object"); the
    warning is attributed to ``jax._src.core``, which pyproject's ``ignore::DeprecationWarning:jax.*`` hides
    from pytest, so every warning is recorded here explicitly around a 2-stage pipeline's build and call."""
    devices = np.array(jax.devices())
    stages = [task(lambda w, x: jnp.tanh(x @ w), f"quiet_stage{i}", mesh=build_mesh({"data": 4}, devices[4 * i:4 * i + 4]))
              for i in range(2)]

    def loss(ws, x):
        for stage, w in zip(stages, ws):
            x = stage(w, x)
        return jnp.mean(x ** 2)

    def step(ws, x):
        value, grads = jax.value_and_grad(microbatch(loss, 0, 4, argnum=1, schedule="1f1b"))(ws, x)
        return value, jax.tree.map(lambda w, g: w - 0.1 * g, ws, grads)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn, init, batch = parallelize(step, init_params=lambda: [jnp.eye(8) * 0.5, jnp.eye(8) * 2.0],
                                      get_input_batch=lambda: jnp.ones((8, 8)))
        jax.block_until_ready(fn(init(), batch()))
    assert fn.plan.schedule.num_stages == 2
    about_jaxprs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                    if "DebugInfo" in str(w.message) or "/multimesh/" in w.filename]
    assert about_jaxprs == []
