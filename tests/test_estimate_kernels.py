"""Kernels read from compiled HLO (flops, bytes, loop counts) and a program timed as the sum of their rooflines
(a scanned stack's bytes per layer: `test_estimate.py`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from multimesh.estimate import calibrate, get_profile
from multimesh.estimate.kernels import Kernel, find_kernels
from multimesh.estimate.programs import ProgramCost
from multimesh.estimate.timing import program_time
from multimesh.jax import build_mesh, parallelize

HLO = "\n".join([
    "HloModule jit_step, entry_computation_layout={(f32[64,32]{1,0})->f32[64,16]{1,0}}",
    "%product (p0: f32[64,32], p1: f32[32,16]) -> f32[64,16] {",
    "  %p0 = f32[64,32]{1,0} parameter(0)",
    "  %p1 = f32[32,16]{1,0} parameter(1)",
    "  ROOT %d = f32[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    "}",
    "%read_layer (q0: f32[5,32,16], q1: s32[]) -> f32[32,16] {",
    "  %q0 = f32[5,32,16]{2,1,0} parameter(0)",
    "  %q1 = s32[] parameter(1)",
    "  %z = s32[] constant(0)",
    "  ROOT %ds = f32[1,32,16]{2,1,0} dynamic-slice(%q0, %q1, %z, %z), dynamic_slice_sizes={1,32,16}",
    "}",
    "%write_layer (r0: f32[5,64,16], r1: f32[1,64,16], r2: s32[]) -> f32[5,64,16] {",
    "  %r0 = f32[5,64,16]{2,1,0} parameter(0)",
    "  %r1 = f32[1,64,16]{2,1,0} parameter(1)",
    "  %r2 = s32[] parameter(2)",
    "  %z2 = s32[] constant(0)",
    "  ROOT %dus = f32[5,64,16]{2,1,0} dynamic-update-slice(%r0, %r1, %r2, %z2, %z2)",
    "}",
    "%add (a: f32[], b: f32[]) -> f32[] {",
    "  ROOT %s = f32[] add(%a, %b)",
    "}",
    "%body (t: (s32[], f32[5,32,16], f32[5,64,16])) -> (s32[], f32[5,32,16], f32[5,64,16]) {",
    "  %t = (s32[], f32[5,32,16], f32[5,64,16]) parameter(0)",
    "  %i = s32[] get-tuple-element(%t), index=0",
    "  %stack = f32[5,32,16]{2,1,0} get-tuple-element(%t), index=1",
    "  %acts = f32[5,64,16]{2,1,0} get-tuple-element(%t), index=2",
    "  %w = f32[1,32,16]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%read_layer",
    "  %h = f32[1,64,16]{2,1,0} custom-call(%x, %w), custom_call_target=\"__cublas$gemm\", "
    'backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
    '"rhs_contracting_dimensions":["1"]}}}',
    "  %ar = f32[1,64,16]{2,1,0} all-reduce(%h), replica_groups={{0,1}}, to_apply=%add",
    "  %acts2 = f32[5,64,16]{2,1,0} fusion(%acts, %ar, %i), kind=kLoop, calls=%write_layer",
    "  ROOT %out = (s32[], f32[5,32,16], f32[5,64,16]) tuple(%i, %stack, %acts2)",
    "}",
    "%cond (c: (s32[], f32[5,32,16], f32[5,64,16])) -> pred[] {",
    "  %c = (s32[], f32[5,32,16], f32[5,64,16]) parameter(0)",
    "  %ci = s32[] get-tuple-element(%c), index=0",
    "  %n = s32[] constant(5)",
    "  ROOT %lt = pred[] compare(%ci, %n), direction=LT",
    "}",
    "ENTRY %main (x: f32[64,32], y: f32[32,16]) -> f32[64,16] {",
    "  %x = f32[64,32]{1,0} parameter(0)",
    "  %y = f32[32,16]{1,0} parameter(1)",
    "  %prod = f32[64,16]{1,0} fusion(%x, %y), kind=kOutput, calls=%product",
    "  %init = (s32[], f32[5,32,16], f32[5,64,16]) tuple(%x, %y, %x)",
    '  %loop = (s32[], f32[5,32,16], f32[5,64,16]) while(%init), condition=%cond, body=%body, '
    'backend_config={"known_trip_count":{"n":"5"}}',
    "  ROOT %copy = f32[64,16]{1,0} copy(%prod)",
    "}",
])


def test_kernels_are_read_with_their_products_bytes_and_loop_counts():
    kernels = find_kernels(HLO)
    f32 = 4
    expected = {
        # the fused product once (2 x 64 x 16 x 32 flops; both operands read, its result written) and, per
        # iteration, the gemm library call from its printed dimension numbers (x is 64 x 32: contracts 32),
        # which moves as many bytes: kernels alike are merged, their counts summed
        (2 * 64 * 16 * 32, (64 * 32 + 32 * 16 + 64 * 16) * f32, 1 + 5),
        # the entry's copy reads and writes 64 x 16
        (0, 2 * 64 * 16 * f32, 1),
        # per iteration: one layer's slice of the stack (not the whole stack) read and written, and the index
        (0, 2 * 32 * 16 * f32 + 4, 5),
        # per iteration: one layer's activations written into the stack in place (the update, read and
        # written, and the index), not the whole stack
        (0, 2 * 64 * 16 * f32 + 4, 5),
        # the loop condition's compare (a kernel of next to nothing), once per iteration
        (0, 1 + 4 + 4, 5),
    }
    assert {(k.flops, k.bytes, k.count) for k in kernels} == expected
    # parameters, tuples, get-tuple-element, constants, the while and the all-reduce are not kernels
    assert sum(k.count for k in kernels) == 1 + 1 + 5 + 5 + 5 + 5


def test_a_program_takes_the_sum_of_its_kernels_rooflines():
    h100 = get_profile("h100-sxm")
    rate, bw = h100.peak_flops["bfloat16"] * h100.achievable_matmul_fraction, h100.memory_bandwidth
    compute_bound = Kernel(flops=1e12, bytes=10**6, count=2)  # 1e12 flops: ~1 ms; 1 MB: ~0.3 us
    memory_bound = Kernel(flops=1e6, bytes=10**10, count=1)  # 10 GB: ~3 ms
    p = ProgramCost("p", frozenset({0}), 0, 0, 0, 0, flops=2e12 + 1e6 + 5e11, bytes_accessed=2e6 + 1e10,
                    collectives=(), kernels=(compute_bound, memory_bound), platform="gpu")
    t = program_time(p, h100, "bfloat16")
    # 5e11 flops no kernel shows (a library call whose dimensions are not printed) count at the same rate
    assert t.kernels == pytest.approx(2 * 1e12 / rate + 1e10 / bw + 5e11 / rate)
    assert t.work == pytest.approx(t.kernels)
    # the whole program's roofline would hide the memory-bound kernel under the compute-bound ones
    assert t.work > max(t.compute, t.memory)
    # XLA:CPU's kernels priced as a GPU: the same sum (XLA:GPU runs products as library kernels and the
    # elementwise work as kernels of its own)
    elsewhere = program_time(dataclasses.replace(p, platform="cpu"), h100, "bfloat16")
    assert elsewhere.kernels == pytest.approx(t.kernels)
    # no kernels read, or XLA:CPU's priced as a TPU (whose compiler fuses the elementwise work into the
    # products): one roofline over the whole program
    unread = program_time(dataclasses.replace(p, kernels=()), h100, "bfloat16")
    tpu = get_profile("tpu-v5p")
    on_tpu = program_time(dataclasses.replace(p, platform="cpu"), tpu, "bfloat16")
    assert unread.kernels is None and unread.work == pytest.approx(max(t.compute, t.memory))
    assert on_tpu.kernels is None and on_tpu.work == pytest.approx(max(on_tpu.compute, on_tpu.memory))
    assert on_tpu.compute == pytest.approx(p.flops / tpu.peak_flops["bfloat16"])
    assert tpu.platform == "tpu" and {get_profile(n).platform for n in ("h100-sxm", "h200", "a100-80gb")} == {"gpu"}


@pytest.mark.devices(8)
def test_a_step_is_priced_kernel_by_kernel_on_its_own_platform_and_on_gpus_but_not_on_tpus():
    def init():
        return {"w": jax.random.normal(jax.random.key(0), (64, 64))}

    def step(p, batch):
        return jax.grad(lambda p: jnp.mean(jnp.tanh(batch["x"] @ p["w"]) ** 2))(p)

    fn, _, _ = parallelize(step, init_params=init, get_input_batch=lambda: {"x": jnp.ones((32, 64))},
                           mesh=build_mesh({"data": 8}), rules=[("batch", "data")])
    here = calibrate(matmul_size=64, copy_bytes=1 << 16, collective_bytes=1 << 16, repeats=1)
    assert here.platform == "cpu"
    local, sheet, tpu = (fn.estimate(profile=p) for p in (here, "h100-sxm", "tpu-v5p"))
    (program,) = local.programs
    assert program.platform == "cpu" and program.kernels
    timed = local.time.programs[program.name]
    assert timed.kernels is not None and timed.total == pytest.approx(timed.launch + timed.kernels
                                                                      + timed.communication)
    assert any("sum of its kernels' rooflines (compiled for cpu" in n for n in local.notes)
    assert sheet.time.programs[program.name].kernels is not None
    assert any("sum of its kernels' rooflines (compiled for cpu, priced as gpu: matrix products as library" in n
               for n in sheet.notes)
    assert tpu.time.programs[program.name].kernels is None
    assert any("one roofline per program (compiled for cpu, priced as tpu" in n for n in tpu.notes)


FLASH_HLO = """HloModule flash

ENTRY %main (q: bf16[2,128,4,64], k: bf16[2,128,2,64], v: bf16[2,128,2,64]) -> bf16[2,128,4,64] {
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(0)
  %k = bf16[2,128,2,64]{3,2,1,0} parameter(1)
  %v = bf16[2,128,2,64]{3,2,1,0} parameter(2)
  %fmha = (bf16[2,128,4,64]{3,2,1,0}, f32[2,4,128]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"mask_type":"MASK"}}
  %s = f32[2,4,128]{2,1,0} get-tuple-element(%fmha), index=1
  %o = bf16[2,128,4,64]{3,2,1,0} get-tuple-element(%fmha), index=0
  %bwd = (bf16[2,128,4,64]{3,2,1,0}, bf16[2,128,2,64]{3,2,1,0}, bf16[2,128,2,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v, %s, %o, %o), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config":{"mask_type":"MASK"}}
  ROOT %dq = bf16[2,128,4,64]{3,2,1,0} get-tuple-element(%bwd), index=0
}
"""


@pytest.mark.parametrize("mask,fraction", [("CAUSAL", 0.5), ("NO_MASK", 1.0)])
def test_a_cudnn_flash_attention_call_counts_its_products_and_no_score_bytes(mask, fraction):
    """cuDNN's fused attention (jax.nn.dot_product_attention on a GPU) prints no dimension numbers: its
    products are counted from its query and key, two forward and five backward, half of them under a causal
    mask; its score matrices stay on chip."""
    kernels = find_kernels(FLASH_HLO.replace("MASK", mask))
    one_product = 2.0 * 2 * 4 * 128 * 128 * 64  # batch x heads x length x kv_length x head_dim
    flops = sorted(k.flops for k in kernels)
    assert flops == [2 * one_product * fraction, 5 * one_product * fraction]
    assert all(k.dtype == "bfloat16" and k.attention_bytes == 0 for k in kernels)


@pytest.mark.devices(8)
def test_a_grouped_product_is_priced_at_its_real_work_on_a_gpu_and_as_compiled_on_its_own_platform():
    """XLA:CPU compiles ``ragged_dot`` into one dense product over every group, masked; a GPU runs a grouped
    GEMM over the real rows. Priced on an H100 from a CPU compilation, the program's kernels carry the grouped
    products' flops (forward and the weights' gradient, each 2 M K N) and bytes (operands and result once); priced
    on the platform it was compiled for, the dense product XLA made."""
    m, k, n, g = 64, 32, 16, 8
    sizes = jnp.array([8, 0, 16, 8, 8, 8, 8, 8], jnp.int32)

    def init():
        return {"w": jax.random.normal(jax.random.key(0), (g, k, n)) * 0.1}

    def step(p, batch):
        return jax.grad(lambda p: jnp.sum(jax.lax.ragged_dot(batch["x"], p["w"], sizes) ** 2))(p)

    fn, _, _ = parallelize(step, init_params=init, get_input_batch=lambda: {"x": jnp.ones((m, k))},
                           mesh=build_mesh({"data": 1}, devices=jax.devices()[:1]), rules=[])
    real = 2 * 2 * m * k * n  # the product and the weights' gradient, each row through its own group

    def kernel_flops(est):
        (program,) = est.programs
        return sum(kern.flops * kern.count for kern in program.kernels)

    gpu = fn.estimate(profile="h100-sxm")
    assert kernel_flops(gpu) == real
    (program,) = gpu.programs
    assert not any(kern.grouped for kern in program.kernels)
    x, w, out, sizes_b = m * k * 4, g * k * n * 4, m * n * 4, g * 4
    # forward: x, w, sizes -> y; the weights' gradient: x, dy, sizes -> dw
    assert sorted(kern.bytes for kern in program.grouped) == [x + w + sizes_b + out, x + out + sizes_b + w]
    own = fn.estimate(profile=dataclasses.replace(get_profile("h100-sxm"), platform="cpu"))
    assert kernel_flops(own) == g * real  # as compiled: the dense products over every group
    assert any(kern.grouped for kern in own.programs[0].kernels)
    assert gpu.time.programs[program.name].kernels < own.time.programs[program.name].kernels


SHARED_MASK_HLO = """HloModule shared_mask

%mask (m0: s32[4], m1: s32[4]) -> pred[4,32,16] {
  %m0 = s32[4]{0} parameter(0)
  %m1 = s32[4]{0} parameter(1)
  %starts = s32[4,32,16]{2,1,0} broadcast(%m0), dimensions={0}
  %ends = s32[4,32,16]{2,1,0} broadcast(%m1), dimensions={0}
  %iota = s32[4,32,16]{2,1,0} iota(), iota_dimension=1
  %le = pred[4,32,16]{2,1,0} compare(%starts, %iota), direction=LE
  %lt = pred[4,32,16]{2,1,0} compare(%iota, %ends), direction=LT
  ROOT %and = pred[4,32,16]{2,1,0} and(%le, %lt)
}

%expand (e0: pred[4,32,16], e1: f32[32,16]) -> f32[32,64] {
  %e0 = pred[4,32,16]{2,1,0} parameter(0)
  %e1 = f32[32,16]{1,0} parameter(1)
  %rows = f32[4,32,16]{2,1,0} broadcast(%e1), dimensions={1,2}
  %zero = f32[] constant(0)
  %zeros = f32[4,32,16]{2,1,0} broadcast(%zero), dimensions={}
  %masked = f32[4,32,16]{2,1,0} select(%e0, %rows, %zeros)
  %t = f32[32,16,4]{1,0,2} transpose(%masked), dimensions={1,2,0}
  ROOT %flat = f32[32,64]{1,0} bitcast(%t)
}

%product (d0: f32[32,64], d1: f32[64,8]) -> f32[32,8] {
  %d0 = f32[32,64]{1,0} parameter(0)
  %d1 = f32[64,8]{1,0} parameter(1)
  ROOT %dot = f32[32,8]{1,0} dot(%d0, %d1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%scores (s0: pred[4,32,16], s1: f32[4,32,16]) -> f32[4,32,16] {
  %s0 = pred[4,32,16]{2,1,0} parameter(0)
  %s1 = f32[4,32,16]{2,1,0} parameter(1)
  %inf = f32[] constant(-inf)
  %infs = f32[4,32,16]{2,1,0} broadcast(%inf), dimensions={}
  ROOT %masked_scores = f32[4,32,16]{2,1,0} select(%s0, %s1, %infs)
}

ENTRY %main (starts: s32[4], ends: s32[4], x: f32[32,16], w: f32[64,8], s: f32[4,32,16]) -> (f32[32,8], f32[4,32,16]) {
  %starts = s32[4]{0} parameter(0)
  %ends = s32[4]{0} parameter(1)
  %x = f32[32,16]{1,0} parameter(2)
  %w = f32[64,8]{1,0} parameter(3)
  %s = f32[4,32,16]{2,1,0} parameter(4)
  %group_mask = pred[4,32,16]{2,1,0} fusion(%starts, %ends), kind=kLoop, calls=%mask
  %expansion = f32[32,64]{1,0} fusion(%group_mask, %x), kind=kLoop, calls=%expand
  %dense = f32[32,8]{1,0} fusion(%expansion, %w), kind=kOutput, calls=%product
  %other = f32[4,32,16]{2,1,0} fusion(%group_mask, %s), kind=kLoop, calls=%scores
  ROOT %out = (f32[32,8]{1,0}, f32[4,32,16]{2,1,0}) tuple(%dense, %other)
}
"""


def test_a_group_mask_computed_in_a_kernel_of_its_own_is_followed_to_its_expansion_and_product():
    """XLA computes a mask several expansions share once, in its own kernel: the mask, the masked broadcast
    of the rows and the dense product that reads it are the grouped product's; a select of other values
    (an attention's scores) under the same mask is not."""
    kernels = find_kernels(SHARED_MASK_HLO)
    grouped = sorted((k.flops, k.bytes) for k in kernels if k.grouped)
    mask, expansion, product = 4 * 32 * 16, 32 * 64 * 4, (2 * 32 * 8 * 64, (32 * 64 + 64 * 8 + 32 * 8) * 4)
    assert grouped == sorted([(0.0, 2 * 4 * 4 + mask), (0.0, mask + 32 * 16 * 4 + expansion), product])
    assert [k.bytes for k in kernels if not k.grouped] == [mask + 2 * 4 * 32 * 16 * 4]
