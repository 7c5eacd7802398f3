"""What the planner prices: each matrix product at the rate of the dtype it runs in (read from the program),
model vs hardware flop utilisation, and collectives over the links their devices cross."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from multimesh.estimate import (PROFILES, Collective, ImpossibleRateError, collective_time, find_collectives,
                                model_flops)
from multimesh.estimate.kernels import find_kernels
from multimesh.estimate.matmuls import matmul_flops_by_dtype
from multimesh.estimate.timing import compute_time
from multimesh.jax import auto_layout, build_mesh, parallelize

H100 = PROFILES["h100-sxm"]
B, D = 64, 256


def init():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (D, 4 * D)) * 0.02, "w2": jax.random.normal(k2, (4 * D, D)) * 0.02}


def get_batch():
    return {"x": jnp.ones((B, D))}


def loss(params, x):
    """float32 parameters, bfloat16 compute: mixed precision as Flax's ``dtype=bfloat16`` layers run it."""
    w1, w2 = (params[k].astype(jnp.bfloat16) for k in ("w1", "w2"))
    h = jnp.dot(x.astype(jnp.bfloat16), w1)
    y = jnp.dot(jax.nn.gelu(h), w2).astype(jnp.float32)
    return jnp.mean(y ** 2)


def step(params, batch):
    value, grads = jax.value_and_grad(loss)(params, batch["x"])
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def built(mesh: dict, **kw):
    fn, _, _ = parallelize(step, init_params=init, get_input_batch=get_batch, mesh=build_mesh(mesh),
                           rules=[("batch", "data")], param_rules=[(r"w1$", P(None, "fsdp")), (r"w2$", P("fsdp"))],
                           **kw)
    return fn


def test_products_are_counted_in_the_dtype_their_operands_run_in():
    jaxpr = jax.make_jaxpr(jax.grad(loss))(init(), jnp.ones((B, D)))
    by = matmul_flops_by_dtype(jaxpr)
    assert by == {"bfloat16": 5 * (2 * B * D * 4 * D)}  # two products forward, 3 backward (no gradient for x)

    def accumulated(a, b):
        return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)

    one = 2 * 4 * 2 * 8
    assert matmul_flops_by_dtype(jax.make_jaxpr(accumulated)(jnp.ones((4, 8)), jnp.ones((8, 2)))) == {"bfloat16": one}
    # its gradient's products take the float32 cotangent with a bfloat16 operand: float32 work
    grad = jax.make_jaxpr(jax.grad(lambda a, b: accumulated(a, b).sum(), (0, 1)))(jnp.ones((4, 8)), jnp.ones((8, 2)))
    assert matmul_flops_by_dtype(grad) == {"bfloat16": one, "float32": 2 * one}
    wide = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((4, 8)), jnp.ones((8, 2)))
    assert matmul_flops_by_dtype(wide) == {"float32": one}


def test_a_compiled_products_dtype_is_read_from_its_operands():
    hlo = "\n".join([
        "ENTRY %main (a: bf16[64,128], b: bf16[128,32]) -> f32[64,32] {",
        "  %a = bf16[64,128]{1,0} parameter(0)",
        "  %b = bf16[128,32]{1,0} parameter(1)",
        "  ROOT %d = f32[64,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "}",
    ])
    (k,) = find_kernels(hlo)
    assert k.flops == 2 * 64 * 32 * 128 and k.dtype == "bfloat16"


@pytest.mark.devices(8)
def test_a_bfloat16_program_is_priced_at_the_bfloat16_rate_without_asking():
    fn = built({"data": 2, "fsdp": 4})
    est = fn.estimate(profile=H100)  # no dtype=: the parameters are float32, the products bfloat16
    (program,) = est.programs
    matmuls = dict(program.matmul_dtypes)
    assert max(matmuls, key=matmuls.get) == "bfloat16"
    assert est.time.dtype.startswith("bfloat16")
    rest = program.flops - sum(matmuls.values())
    assert compute_time(program, H100) == pytest.approx(program.flops / H100.peak_flops["bfloat16"])
    assert rest >= 0 and est.time.peak == pytest.approx(H100.peak_flops["bfloat16"])
    asked = fn.estimate(profile=H100, dtype="float32")  # the override: every flop at float32's rate
    assert asked.time.dtype == "float32"
    assert compute_time(program, H100, "float32") == pytest.approx(program.flops / H100.peak_flops["float32"])
    assert asked.time.programs[program.name].compute > 10 * est.time.programs[program.name].compute


@pytest.mark.devices(8)
def test_the_layout_search_prices_a_bfloat16_program_at_the_bfloat16_rate():
    search = auto_layout(step, init_params=init, get_input_batch=get_batch, profile="h100-sxm", num_devices=2,
                         axes=("data",), rule_sets=("standard",), progress=False)
    best = search.best_candidate.estimate
    assert best.time.dtype.startswith("bfloat16")
    (program,) = best.programs
    assert best.time.programs[program.name].compute == pytest.approx(compute_time(program, H100)
                                                                     / H100.achievable_matmul_fraction)
    assert search.best_candidate.hfu == best.time.hfu and search.best_candidate.mfu is None
    asked = auto_layout(step, init_params=init, get_input_batch=get_batch, profile="h100-sxm", num_devices=2,
                        axes=("data",), rule_sets=("standard",), progress=False, dtype="float32")
    assert asked.best_candidate.estimate.time.dtype == "float32"
    fn, _, _ = parallelize(step, layout="auto", init_params=init, get_input_batch=get_batch, profile="h100-sxm",
                           num_devices=2, axes=("data",), rule_sets=("standard",), progress=False)
    assert fn.layout_search.best_candidate.estimate.time.dtype.startswith("bfloat16")


def test_model_flops_are_six_per_parameter_and_token_plus_attention():
    assert model_flops(1e9, 1e6) == 6e15
    assert model_flops(0, 10, layers=2, seq_len=8, attention_width=4) == 12 * 2 * 8 * 4 * 10
    with pytest.raises(ValueError, match="tokens=-1"):
        model_flops(1, -1)


@pytest.mark.devices(8)
def test_mfu_counts_the_models_flops_hfu_the_compiled_ones_and_neither_passes_the_peak():
    fn = built({"data": 2, "fsdp": 4})
    est = fn.estimate(profile=H100)
    assert est.time.mfu is None and 0 < est.time.hfu < 1
    assert "HFU" in str(est) and "MFU: pass model_flops=" in str(est)
    work = model_flops(2 * D * 4 * D, B)  # the model's own flops: 6 x parameters x "tokens" (rows)
    given = fn.estimate(profile=H100, model_flops=work)
    assert given.time.mfu == pytest.approx(work / (given.time.total * H100.peak_flops["bfloat16"] * 8))
    assert "MFU" in str(given) and "(model flops)" in str(given)
    with pytest.raises(ImpossibleRateError, match="model_flops"):
        fn.estimate(profile=H100, model_flops=1e6 * est.flops)  # more work than the step does: a bug, not 1e6 MFU


def _group(ids):
    return Collective("all-reduce", 1 << 20, len(ids), ("data",), "ar", devices=(tuple(ids),))


def test_the_same_group_size_costs_more_across_nodes_than_inside_one():
    inside = collective_time(_group(range(8)), H100)  # devices 0..7: one node of 8
    across = collective_time(_group(range(0, 64, 8)), H100)  # one device of each of 8 nodes
    assert inside == pytest.approx(14 * H100.intra_node_latency + 1.75 * (1 << 20) / H100.intra_node_bandwidth)
    # one GPU of each node: its own NIC; 1 MiB is small enough for the tree's 2 log2(8) latency steps to win
    assert across == pytest.approx(6 * H100.inter_node_latency + 2 * (1 << 20) / H100.inter_node_bandwidth)
    # 4 GPUs on each of 2 nodes: they cross over their 4 NICs at once (estimate.network), 4 times the bandwidth
    # (here the hierarchical all-reduce: a reduce-scatter in each node, an all-reduce of a quarter between the
    # nodes over each GPU's own NIC, an all-gather in each node)
    mixed = collective_time(_group([0, 1, 2, 3, 8, 9, 10, 11]), H100)
    in_node = 3 * H100.intra_node_latency + 3 / 4 * (1 << 20) / H100.intra_node_bandwidth
    assert mixed == pytest.approx(2 * in_node + 2 * H100.inter_node_latency
                                  + (1 << 20) / 4 / H100.inter_node_bandwidth)
    assert mixed < across
    unknown = collective_time(Collective("all-reduce", 1 << 20, 8, ("data",), "ar"), H100)
    assert unknown == inside  # devices not read: a group that fits a node is taken to be inside one


def test_replica_groups_are_read_as_device_ids():
    hlo = "  %ar = f32[256]{0} all-reduce(%x), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add"
    (c,) = find_collectives(hlo, ["data", "fsdp"], [2, 4], device_ids=[16, 17, 18, 19, 20, 21, 22, 23])
    assert c.axes == ("data",) and c.devices == ((16, 20), (17, 21), (18, 22), (19, 23))
    assert c.nodes_spanned(lambda d: d // 4) == 2 and c.nodes_spanned(lambda d: d // 8) == 1


@pytest.mark.devices(8)
def test_a_steps_collectives_are_priced_by_the_nodes_their_devices_sit_on():
    fn = built({"data": 2, "fsdp": 4})
    nodes_of_4 = dataclasses.replace(H100, name="h100-nodes-of-4", devices_per_node=4, nics_per_node=4)
    (program,) = fn.estimate(profile=nodes_of_4).programs
    by_axes = {}
    for c in program.collectives:
        by_axes.setdefault(c.axes, set()).add(c.nodes_spanned(nodes_of_4.node_of))
    assert by_axes[("fsdp",)] == {1}  # devices 0-3 and 4-7: each group on its own node
    assert by_axes[("data",)] == {2}  # {0, 4}, ...: across the two nodes
    c = next(c for c in program.collectives if c.axes == ("data",))
    # two devices per group: a size that fits any node, priced over the network because of where they are
    assert collective_time(c, nodes_of_4) == collective_time(dataclasses.replace(c, devices=None),
                                                             dataclasses.replace(nodes_of_4, devices_per_node=1,
                                                                                 nics_per_node=1))
    assert collective_time(c, nodes_of_4) > collective_time(c, H100)


def test_float32_products_run_at_tf32_on_a_gpu_unless_asked_for_full_precision():
    from jax import lax

    from multimesh.estimate.precision import rate_for

    a = jnp.ones((4, 8))
    default = matmul_flops_by_dtype(jax.make_jaxpr(lambda x: x @ x.T)(a))
    highest = matmul_flops_by_dtype(jax.make_jaxpr(lambda x: jnp.dot(x, x.T, precision=lax.Precision.HIGHEST))(a))
    assert set(default) == {"float32"} and set(highest) == {"float32-highest"}
    assert rate_for(H100, "float32") == H100.peak_flops["tfloat32"]  # JAX's default precision on a GPU
    assert rate_for(H100, "float32-highest") == H100.peak_flops["float32"]
    v5e = PROFILES["tpu-v5e"]
    assert rate_for(v5e, "float32") == v5e.peak_flops["float32"] == rate_for(v5e, "float32-highest")


T, HEADS, HEAD_DIM = 256, 4, 16


def attention_loss(params, x):
    """Single-layer causal attention written out (scores, mask, softmax, weighted sum), as the example
    transformer writes it."""
    b, t, _ = x.shape
    q, k, v = (jnp.einsum("btd,dhk->bthk", x, params[n]) for n in ("wq", "wk", "wv"))
    scores = jnp.einsum("bthk,bshk->bhts", q, k) / HEAD_DIM ** 0.5
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    out = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(scores, axis=-1), v)
    return jnp.mean(out ** 2)


def attention_step(params, batch):
    value, grads = jax.value_and_grad(attention_loss)(params, batch["x"])
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.mark.devices(8)
def test_attention_scores_are_left_to_a_flash_kernel_on_another_platform_only():
    def init_attention():
        keys = jax.random.split(jax.random.key(0), 3)
        return {n: jax.random.normal(k, (D, HEADS, HEAD_DIM)) * 0.02 for n, k in zip(("wq", "wk", "wv"), keys)}

    fn, _, _ = parallelize(attention_step, init_params=init_attention,
                           get_input_batch=lambda: {"x": jnp.ones((8, T, D))}, mesh=build_mesh({"data": 8}),
                           rules=[("batch", "data")], param_rules=[(r".*", P())])
    (program,) = fn.estimate().programs
    one_score_matrix = (8 // 8) * HEADS * T * T * 4  # per device: its one sequence's heads, float32
    # forward (scores, masked, softmax) and backward (their gradients) each write and read such matrices
    assert program.attention_bytes >= 4 * one_score_matrix
    assert program.attention_bytes < program.bytes_accessed
    from multimesh.estimate.timing import memory_bytes

    assert memory_bytes(program, H100) == program.bytes_accessed - program.attention_bytes  # a GPU's flash kernel
    here = dataclasses.replace(H100, platform="cpu")  # priced as the platform it was compiled for: as compiled
    assert memory_bytes(program, here) == program.bytes_accessed
    (plain,) = built({"data": 2, "fsdp": 4}).estimate().programs
    assert plain.attention_bytes == 0  # an MLP's products are no attention
