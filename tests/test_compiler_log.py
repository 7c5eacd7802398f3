"""XLA's resharding warnings while an estimate compiles: kept with the program they came from, off stderr."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

from multimesh.autolayout import auto_layout
from multimesh.estimate import Reshard
from multimesh.estimate.compiler_log import compile_noting_reshards, split_reshards
from multimesh.jax import parallelize

pytestmark = pytest.mark.devices(8)

#: the batch's rows over data x fsdp
BATCH_RULES = [("batch", ("data", "fsdp"))]

#: two lines XLA's SPMD partitioner logged (jaxlib 0.12): for the step below on data=2 x fsdp=4, and for the
#: Gemma example (tests/thirdparty) on data=4 x tp=2, which names the JAX operation
_TAIL = (". As the last resort, SPMD will replicate the tensor and then partition it to obtain the target sharding, "
         "which is inefficient. This issue will be fixed by Shardy partitioner in the future, which is tracked in "
         "b/433785288. Contact Shardy or XLA team for help.\n")
WARNING = (
    "W1127 02:17:28.370314    7246 spmd_partitioner.cc:666] [SPMD] Involuntary full rematerialization. The compiler "
    "cannot go from sharding {mesh['data'=2,'fsdp'=4], [{'data', 'fsdp'}, {}, {}]} to {mesh['data'=2,'fsdp'=4], "
    "[{}, {}, {'data'}]} efficiently for HLO operation %gather = f32[2,8,16]{2,1,0} gather(%all-gather, "
    "%fake_parameter.1), offset_dims={2}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=2, "
    "slice_sizes={1,16}, sharding={mesh['data'=2,'fsdp'=4], [{'data', 'fsdp'}, {}, {}]}" + _TAIL)
GEMMA_WARNING = (
    "W1127 02:12:35.981303    5615 spmd_partitioner.cc:666] [SPMD] Involuntary full rematerialization. The compiler "
    "cannot go from sharding {devices=[1,2,4]<=[4,2]T(1,0) last_tile_dim_replicate} to {mesh['data'=4,'tp'=2,"
    "'fsdp'=1], [{'tp'}, {}]} efficiently for HLO operation %all-reduce = f32[32,8]{1,0} all-reduce(%scatter), "
    "channel_id=65, replica_groups=mesh['data'=4,'tp'=2,'fsdp'=1] {'data'}, use_global_device_ids=true, "
    "to_apply=%region_42.43.clone.1.clone, sharding={devices=[1,2,4]<=[4,2]T(1,0) last_tile_dim_replicate}, "
    "frontend_attributes={is_spmd_generated=\"true\"}, metadata={op_name=\"jit(step)/transpose(jvp(jit(_take)))/"
    "scatter-add\" stack_frame_id=19}" + _TAIL)


def test_the_warnings_are_read_and_the_rest_kept_as_it_was():
    other = "W1127 02:16:58.1 some.cc:1] something else\nno newline at the end"
    found, rest = split_reshards("first line\n" + WARNING + GEMMA_WARNING + other)
    assert found == (
        Reshard(shape="f32[2,8,16]{2,1,0}", source="{mesh['data'=2,'fsdp'=4], [{'data', 'fsdp'}, {}, {}]}",
                target="{mesh['data'=2,'fsdp'=4], [{}, {}, {'data'}]}", instruction="gather"),
        Reshard(shape="f32[32,8]{1,0}", source="{devices=[1,2,4]<=[4,2]T(1,0) last_tile_dim_replicate}",
                target="{mesh['data'=4,'tp'=2,'fsdp'=1], [{'tp'}, {}]}", instruction="all-reduce",
                op="jit(step)/transpose(jvp(jit(_take)))/scatter-add"))
    assert rest == "first line\n" + other
    assert found[0].describe() == ("f32[2,8,16] at %gather: from {mesh['data'=2,'fsdp'=4], [{'data', 'fsdp'}, {}, {}]} "
                                   "to {mesh['data'=2,'fsdp'=4], [{}, {}, {'data'}]}")
    assert found[1].describe().startswith("f32[32,8] at jit(step)/transpose(jvp(jit(_take)))/scatter-add: from {")


class _Lowered:
    """Writes to file descriptor 2 as XLA's C++ logging does, while it compiles."""

    def __init__(self, text: str, fail: bool = False):
        self.text, self.fail = text, fail

    def as_text(self) -> str:  # the program's text (an estimate keys what XLA said by it)
        return f"module @fake {{ {self.text!r} }}"

    def compile(self):
        os.write(2, self.text.encode())
        if self.fail:
            raise RuntimeError("compilation failed")
        return "compiled"


def test_compiling_keeps_the_warnings_and_passes_the_rest_to_stderr(capfd):
    compiled, found = compile_noting_reshards(_Lowered("before\n" + WARNING + "after\n"))
    assert compiled == "compiled" and [r.instruction for r in found] == ["gather"]
    assert capfd.readouterr().err == "before\nafter\n"
    with pytest.raises(RuntimeError, match="compilation failed"):  # what a failed compile said is not lost
        compile_noting_reshards(_Lowered("why it failed\n" + WARNING, fail=True))
    assert capfd.readouterr().err == "why it failed\n"


def _embedding_step():
    """A table whose features are split over ``data`` and tokens over data x fsdp: XLA gathers the looked-up
    rows whole to reshard them (the pattern of nanodo's embedding in tests/thirdparty)."""
    tx = optax.sgd(0.1)

    def init():
        table = jax.random.normal(jax.random.key(0), (32, 16))
        return {"params": table, "opt": tx.init(table)}

    def batch():
        return {"tokens": jnp.arange(16 * 8, dtype=jnp.int32).reshape(16, 8) % 32}

    def step(state, b):
        loss, grad = jax.value_and_grad(lambda t: (t[b["tokens"]] ** 2).mean())(state["params"])
        updates, opt = tx.update(grad, state["opt"])
        return loss, {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    return step, init, batch, {r"params$": P(None, "data")}


def test_an_estimate_names_the_arrays_xla_reshards_whole_and_stderr_stays_clean(capfd):
    step, init, batch, rules = _embedding_step()
    fn, _, _ = parallelize(step, init_params=init, get_input_batch=batch, mesh={"data": 2, "fsdp": 4},
                           param_rules=rules, rules=BATCH_RULES)
    est = fn.estimate("h100-sxm")
    assert est.reshards and all(name == est.programs[0].name for name, _ in est.reshards)
    # the gather's rows per device
    assert [(r.instruction, r.shape.split("{")[0]) for _, r in est.reshards] == [("gather", "f32[2,8,16]")]
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    assert "XLA reshards" in str(est) and est.reshards[0][1].describe() in str(est)
    assert fn.estimate("a100-80gb").reshards == est.reshards  # its compiled program reused, the warnings with it


def test_a_step_xla_shards_as_asked_has_no_reshards():
    step, init, batch, _ = _embedding_step()
    fn, _, _ = parallelize(step, init_params=init, get_input_batch=batch, mesh={"data": 2, "fsdp": 4},
                           param_rules={r"params$": P(None, None)}, rules=BATCH_RULES)
    est = fn.estimate("h100-sxm")
    assert est.reshards == () and "XLA reshards" not in str(est)


def test_the_search_table_names_the_layouts_where_xla_reshards(capfd):
    step, init, batch, rules = _embedding_step()
    found = auto_layout(step, init_params=init, get_input_batch=batch, profile="h100-sxm", axes=("data", "fsdp"),
                        param_rules=rules, rule_sets=("standard",))
    resharding = [c.layout.describe() for c in found.candidates if c.estimate is not None and c.estimate.reshards]
    assert "data=2 x fsdp=4" in resharding and "data=8" not in resharding
    note = next(line for line in str(found).splitlines() if "XLA reshards" in line)
    assert all(f"{d} (" in note for d in resharding)
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


#: one process's estimate of the lookup step on data=2 x fsdp=4 (XLA gathers the looked-up rows whole), with
#: JAX's persistent cache on and every program written to it; prints the reshards' instructions, the cache hits
#: and the warnings
_PROCESS = """
import json, warnings
import jax, jax.numpy as jnp, jax.monitoring, optax
from jax.sharding import PartitionSpec as P
from multimesh.jax import parallelize
hits = []
jax.monitoring.register_event_listener(lambda e, **_: hits.append(e) if e.endswith("cache_hits") else None)
tx = optax.sgd(0.1)
def init():
    t = jax.random.normal(jax.random.key(0), (32, 16))
    return {"params": t, "opt": tx.init(t)}
def step(state, batch):
    loss, g = jax.value_and_grad(lambda t: (t[batch["tokens"]] ** 2).mean())(state["params"])
    u, opt = tx.update(g, state["opt"])
    return loss, {"params": optax.apply_updates(state["params"], u), "opt": opt}
fn, _, _ = parallelize(step, init_params=init, get_input_batch=lambda: {"tokens": jnp.zeros((16, 8), jnp.int32)},
                       mesh={"data": 2, "fsdp": 4}, rules=[("batch", ("data", "fsdp"))],
                       param_rules=[(r"params$", P(None, "data"))])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    est = fn.estimate()
print(json.dumps({"reshards": [r.instruction for _, r in est.reshards], "hits": len(hits),
                  "warnings": [type(w.message).__name__ for w in caught]}))
"""


def test_reshards_survive_jax_s_persistent_compilation_cache(tmp_path):
    """A program JAX reads from its persistent cache is not compiled, and XLA warns only while compiling:
    the warnings an estimate's compile saw are kept beside the cache and read back; where the cache holds a
    program without them, the estimate says they are unknown (a warning) instead of reporting none."""
    import json
    import subprocess
    import sys

    script = tmp_path / "estimate.py"
    script.write_text(_PROCESS)
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}

    def run() -> dict:
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = run()
    assert first["reshards"] == ["gather"] and first["warnings"] == []
    second = run()  # the same programs, now read from the cache
    assert second["hits"] > 0
    assert second["reshards"] == ["gather"] and second["warnings"] == []
    for kept in (tmp_path / "cache").glob("multimesh-reshards-*.json"):
        kept.unlink()
    third = run()
    assert third["hits"] > 0 and third["reshards"] == []
    assert "UnknownReshardsWarning" in third["warnings"]
