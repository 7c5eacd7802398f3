"""Flops per device: XLA's analysis of the compiled program, floored by the program's own count before
partitioning (the compiled analysis of a GPU program leaves out cuBLAS's matrix products)."""

import jax
import jax.numpy as jnp

from multimesh.estimate.programs import _flops


class _Stage:
    def __init__(self, flops):
        self.flops = flops

    def cost_analysis(self):
        return {"flops": self.flops}


def test_a_compiled_count_that_leaves_out_library_calls_is_floored_by_the_lowered_count_per_device():
    assert _flops(_Stage(1.0e6), _Stage(8.0e9), n_devices=8) == 1.0e9   # GPU: the gemms missing
    assert _flops(_Stage(3.0e9), _Stage(8.0e9), n_devices=8) == 3.0e9   # replicated work counts in full
    assert _flops(_Stage(5.0), None, n_devices=8) == 5.0


def test_both_counts_agree_where_the_compiled_analysis_counts_the_products():
    lowered = jax.jit(lambda a, b: a @ b).lower(jax.ShapeDtypeStruct((64, 32), jnp.float32),
                                               jax.ShapeDtypeStruct((32, 16), jnp.float32))
    compiled = lowered.compile()
    assert _flops(compiled, lowered, 1) == compiled.cost_analysis()["flops"] == 2 * 64 * 32 * 16
