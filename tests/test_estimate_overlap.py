"""Collectives that can run beside the compute and those that cannot (a product before and after), and a
program priced with them on GPU/TPU profiles (beside the compute) and on a CPU (after it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.estimate import HardwareProfile, get_profile
from multimesh.estimate.collectives import Collective, find_collectives
from multimesh.estimate.programs import ProgramCost
from multimesh.estimate.timing import collective_time, program_time
from multimesh.jax import build_mesh


def _collectives(fn, mesh, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    return find_collectives(compiled.as_text(), list(mesh.axis_names), list(mesh.devices.shape))


@pytest.mark.devices(8)
def test_a_tensor_parallel_reduction_between_two_products_is_critical():
    mesh = build_mesh({"model": 8})
    x = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P()))
    a = jax.device_put(jnp.ones((64, 128)), NamedSharding(mesh, P(None, "model")))
    b = jax.device_put(jnp.ones((128, 64)), NamedSharding(mesh, P("model", None)))
    c = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P()))

    def mlp(x, a, b, c):  # the partial sums of x @ a @ b are reduced before the next product needs them
        return jnp.tanh(jnp.tanh(x @ a) @ b) @ c

    found = _collectives(mlp, mesh, x, a, b, c)
    assert found and all(c.critical for c in found), found


@pytest.mark.devices(8)
def test_a_parameter_gather_and_a_gradient_reduction_are_not_critical():
    mesh = build_mesh({"fsdp": 8})
    w = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("fsdp", None)))
    x = jax.device_put(jnp.ones((32, 64)), NamedSharding(mesh, P("fsdp", None)))

    def step(w, x):  # FSDP: the weight gathered before its product, its gradient reduced after the last
        g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * jax.lax.with_sharding_constraint(g, NamedSharding(mesh, P("fsdp", None)))

    found = _collectives(step, mesh, w, x)
    kinds = {c.kind for c in found}
    assert "all-gather" in kinds and kinds & {"all-reduce", "reduce-scatter"}, found
    assert not any(c.critical for c in found), found


def _program(collectives: tuple[Collective, ...], platform: str = "cpu") -> ProgramCost:
    return ProgramCost("p", frozenset(range(8)), 0, 0, 0, 0, flops=1e12, bytes_accessed=1e9,
                       collectives=collectives, platform=platform, matmul_dtypes=(("bfloat16", 1e12),))


def test_collectives_beside_the_compute_on_gpus_and_tpus_and_after_it_on_a_cpu():
    gather = Collective("all-gather", 2 * 10**9, 8, ("fsdp",), "ag", devices=(tuple(range(8)),))
    reduce = Collective("all-reduce", 10**8, 8, ("model",), "ar", devices=(tuple(range(8)),), critical=True)
    for name in ("h100-sxm", "tpu-v5p"):
        profile = get_profile(name)
        t = program_time(_program((gather, reduce)), profile, "bfloat16")
        g, r = collective_time(gather, profile), collective_time(reduce, profile)
        assert t.communication == pytest.approx(g + r) and t.overlapped == pytest.approx(g)
        # the gather hides under the compute while it is shorter, and the reduction always adds its time
        assert t.work == pytest.approx(max(t.bound, g) + r)
        small = program_time(_program((dataclasses.replace(gather, bytes=10**6), reduce)), profile, "bfloat16")
        assert small.work == pytest.approx(small.bound + r)
        assert t.bound < g and t.work == pytest.approx(g + r)  # this gather outlasts the compute
    cpu = dataclasses.replace(get_profile("h100-sxm"), name="host", platform="cpu")
    t = program_time(_program((gather, reduce)), cpu, "bfloat16")
    assert t.overlapped == 0 and t.work == pytest.approx(t.bound + t.communication)


def test_flops_take_the_measured_achievable_fraction_of_the_peak():
    h100 = get_profile("h100-sxm")
    assert h100.achievable_matmul_fraction == pytest.approx(671.4 / 989.5)  # XLA's rate, measured on an H200
    assert any("671.4" in n and "RESULTS.md" in n for n in h100.notes)
    assert get_profile("h200").achievable_matmul_fraction == h100.achievable_matmul_fraction  # the same GH100
    assert get_profile("a100-80gb").achievable_matmul_fraction == pytest.approx(271.2 / 312)
    t = program_time(_program(()), h100)
    assert t.compute == pytest.approx(1e12 / (h100.peak_flops["bfloat16"] * h100.achievable_matmul_fraction))
    assert get_profile("tpu-v5e").achievable_matmul_fraction == 1.0  # no independent measurement: the peak
    with pytest.raises(ValueError, match=r"achievable_matmul_fraction=1.5 must be a fraction in \(0, 1\]"):
        dataclasses.replace(h100, achievable_matmul_fraction=1.5)
    assert isinstance(h100, HardwareProfile)
