"""Bad inputs, as a new user gives them: each one raises a clear error that names the offending object.

One table (`CASES`): an id, a function that makes the mistake, the exception
type expected, and substrings the message must contain (the path, task, key,
regex, step or value at fault, and what was expected). It covers rules,
`parallelize` and the steps it builds (called with wrong, donated or
misplaced inputs, returning non-arrays), tasks and pipelines,
`register_task`, checkpoints, and the trainer's CLI and configs. The focused
tests at the end check the errors that replaced silent or obscure behaviour
(donated state reused, a parameter of another shape, a state laid out for
another mesh, a batch that does not divide at call time, a step returning a
string) on both SPMD and MPMD steps, and that a good call still works after.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.checkpoint import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointSaveError,
    abstract_target,
)
from multimesh.core.rules import check_physical
from multimesh.distributed import StartupError
from multimesh.jax import (
    DonatedArrayError,
    PathRules,
    RuleError,
    Rules,
    RuleWarning,
    StepInputError,
    build_mesh,
    get_schedule,
    microbatch,
    parallelize,
    place_mesh,
    register_task,
    resolve,
    shard_map,
    slice_mesh,
    task,
    with_sharding_constraint,
)
from multimesh.jax import flax as mmflax
from multimesh.jax.flax import parallelize_step

pytestmark = [
    pytest.mark.devices(8),
    pytest.mark.filterwarnings("ignore:parallelize. no rules=:UserWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),  # Orbax on failed reads
]

MESH = {"data": 4, "model": 2}


# ---------------------------------------------------------------------------------------------------------------
# Shared objects, built once per module on first use
# ---------------------------------------------------------------------------------------------------------------


def spmd_step(p, b):
    """A tiny step: the loss and the parameters scaled (the new params mirror the old ones)."""
    return jnp.sum(b["x"] @ p["w"] + p["b"]), {"w": p["w"] * 0.5, "b": p["b"]}


def spmd_params():
    return {"w": jnp.ones((16, 8)), "b": jnp.ones(8)}


def spmd_batch(n: int = 32, features: int = 16):
    return {"x": np.ones((n, features), np.float32)}


def _stage(w, x):
    return jnp.tanh(x @ w)


STAGES = None


def _stages():
    global STAGES
    if STAGES is None:
        devs = jax.devices()
        STAGES = [task(_stage, f"stage{i}", mesh=build_mesh({"data": 2, "model": 2}, devs[4 * i:4 * i + 4]))
                  for i in range(2)]
    return STAGES


def pipeline_step(state, b):
    """Two stages, two microbatches of 4, SGD: the loss and the new state."""
    stages = _stages()

    def loss(p, mb):
        h = stages[1](p["s1"], stages[0](p["s0"], mb["x"]))
        return jnp.sum((h - mb["y"]) ** 2) / 8

    def grads(p, mb):
        return jax.value_and_grad(loss)(p, mb)

    value, g = microbatch(grads, 0, 4, argnum=1, schedule="gpipe")(state, b)
    return value, jax.tree.map(lambda p, d: p - 0.1 * d, state, g)


def pipeline_params():
    k0, k1 = jax.random.split(jax.random.key(0))
    return {"s0": jax.random.normal(k0, (16, 16)) * 0.1, "s1": jax.random.normal(k1, (16, 16)) * 0.1}


def pipeline_batch(n: int = 8):
    return {"x": jnp.ones((n, 16)), "y": jnp.zeros((n, 16))}


class Shared:
    """Steps, states and a checkpoint directory that several cases use (each built on first use)."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._cache: dict = {}

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def spmd(self):
        """``(step, init)`` of `spmd_step` on MESH, w sharded over 'model'."""
        return self._get("spmd", lambda: parallelize(
            spmd_step, init_params=spmd_params, initial_batch=spmd_batch(), mesh=MESH,
            rules=[("batch", "data")], param_rules={"w": P(None, "model")}))

    @property
    def mpmd(self):
        """``(step, init, get_batch)`` of `pipeline_step`, donating its state."""
        return self._get("mpmd", lambda: parallelize(
            pipeline_step, init_params=pipeline_params, get_input_batch=pipeline_batch, donate=True))

    def tmp(self, name: str) -> str:
        return str(self._tmp.mktemp(name))

    @property
    def ckpt(self) -> str:
        """A directory holding checkpoint step 1 of `ckpt_state`."""
        def make():
            d = self.tmp("ckpt")
            with CheckpointManager(d, async_save=False) as mgr:
                mgr.save(1, ckpt_state())
            return d
        return self._get("ckpt", make)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return Shared(tmp_path_factory)


def ckpt_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def ckpt_state() -> dict:
    m = ckpt_mesh()
    return {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(m, P("data", "model"))),
            "b": jax.device_put(jnp.ones(8), NamedSharding(m, P()))}


def ckpt_target(**change) -> dict:
    rep = NamedSharding(ckpt_mesh(), P())
    t = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=rep),
         "b": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=rep)}
    t.update(change)
    return {k: v for k, v in t.items() if v is not None}


# ---------------------------------------------------------------------------------------------------------------
# Helpers the cases use
# ---------------------------------------------------------------------------------------------------------------


def build(fun=spmd_step, *, params=spmd_params, batch=None, **kw):
    return parallelize(fun, init_params=params, initial_batch=spmd_batch() if batch is None else batch, **kw)


def build_and_call(fun, **kw):
    step, init = build(fun, **kw)
    return step(init(), spmd_batch())


def call_spmd(sh: Shared, params=None, batch=None, **change):
    step, init = sh.spmd
    p = init() if params is None else params
    p = {**p, **change}
    return jax.block_until_ready(step(p, spmd_batch() if batch is None else batch))


def other_mesh_params(sh: Shared, mesh: Mesh, w_spec: P | None = None):
    _, init = sh.spmd
    p = init()
    return {"w": jax.device_put(p["w"], NamedSharding(mesh, w_spec or P())), "b": jax.device_put(p["b"], NamedSharding(mesh, P()))}


def reuse_donated(sh: Shared | None = None, *, mpmd: bool = False):
    if mpmd:
        step, init, get_batch = sh.mpmd
        state, b = init(), get_batch()
    else:
        step, init = build(mesh=MESH, rules=[("batch", "data")], donate=True)
        state, b = init(), spmd_batch()
    step(state, b)
    return step(state, b)


def call_mpmd(sh: Shared, *, params=None, batch=None):
    step, init, get_batch = sh.mpmd
    return step(init() if params is None else params(init()), get_batch() if batch is None else batch)


def returns(value):
    def step_returning(p, b):
        return value(p, b)
    return step_returning


def named_scope_step(p, b):
    with jax.named_scope("blk_0"):
        h = b["x"] @ p["w"]
    return jnp.sum(h + p["b"])


def with_registration(regex: str, *, strict: bool = False, **kw):
    with register_task(regex, **kw):
        return build(named_scope_step, mesh=MESH, rules=[("batch", "data")], strict=strict)


def with_callback(result, **kw):
    return with_registration(r"blk_(\d+)", callback=lambda m, backprop: result, **kw)


def mgr(sh: Shared, **kw) -> CheckpointManager:
    return CheckpointManager(sh.ckpt, **kw)


def restore(sh: Shared, step=None, target=None):
    with mgr(sh) as m:
        return m.restore(step, target=ckpt_target() if target is None else target)


def save(directory: str, step, state, **kw):
    with CheckpointManager(directory, async_save=False, **kw) as m:
        m.save(step, state)


def corrupt_meta(sh: Shared) -> str:
    d = sh.tmp("nometa")
    save(d, 3, ckpt_state())
    import shutil
    shutil.rmtree(os.path.join(d, "3", "multimesh"))
    with CheckpointManager(d) as m:
        return m.info(3)


def deleted_under_reader(sh: Shared, what: str):
    """A read-only manager opened on a checkpoint whose directory (or step directory) is then deleted."""
    import shutil

    d = sh.tmp("deleted")
    save(d, 1, ckpt_state())
    with CheckpointManager(d, read_only=True) as m:
        shutil.rmtree(d if what == "directory" else os.path.join(d, "1"))
        return m.restore(target=ckpt_target())


def closed_manager(sh: Shared):
    m = mgr(sh)
    m.close()
    return m.info()


def _initialize(address: str, n: int, process_id: int) -> None:
    """`multimesh.distributed.initialize` for mistakes found before JAX's own start-up (nothing changes)."""
    from multimesh.distributed import initialize

    initialize(address, n, process_id, initialization_timeout=5)


class CliFailed(Exception):
    """The trainer CLI exited non-zero; the message holds the code and what it printed on stderr."""


def cli(*argv: str) -> None:
    from trainers.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code
    if code not in (0, None):
        raise CliFailed(f"exit {code if isinstance(code, int) else 1}: {code if isinstance(code, str) else ''}"
                        f"{err.getvalue()}")


def config_file(sh: Shared, text: str, name: str = "c.yaml") -> str:
    path = os.path.join(sh.tmp("cfg"), name)
    with open(path, "w") as f:
        f.write(text)
    return path


def cycle_config(sh: Shared) -> str:
    d = sh.tmp("cycle")
    for a, b in (("a", "b"), ("b", "a")):
        with open(os.path.join(d, f"{a}.yaml"), "w") as f:
            f.write(f"base: {os.path.join(d, b + '.yaml')}\n")
    return os.path.join(d, "a.yaml")


def load(*overrides: str, config: str | None = None):
    from trainers.config import load_config

    return load_config(config, list(overrides))


def from_dict(raw: dict):
    from trainers.config import config_from_dict

    return config_from_dict(raw)


def _config_error():
    from trainers.config import ConfigError

    return ConfigError


# ---------------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[Shared], object]
    error: type[BaseException] | Callable[[], type[BaseException]]
    names: tuple[str, ...]


def C(id, make, error, *names):  # a table row
    return Case(id, make, error, names)


D = jax.devices
F32 = np.float32

RULES = [
    C("rule-not-a-pair", lambda s: Rules([("batch",)]), RuleError, "rule #0", "('batch',)", "pair"),
    C("rule-triple", lambda s: Rules([("batch", "data"), ("a", "b", "c")]), RuleError, "rule #1", "('a', 'b', 'c')"),
    C("rule-a-string", lambda s: Rules(["batch"]), RuleError, "rule #0", "'batch'"),
    C("rule-logical-name-int", lambda s: Rules([(1, "data")]), RuleError, "(1, 'data')", "must be a str"),
    C("rule-mesh-axes-int", lambda s: Rules([("batch", 3)]), RuleError, "('batch', 3)", "mesh axes"),
    C("rule-mesh-axes-tuple-with-int", lambda s: Rules([("batch", ("data", 1))]), RuleError, "('data', 1)"),
    C("rule-axis-twice", lambda s: Rules([("batch", ("data", "data"))]), RuleError, "('data', 'data')", "twice"),
    C("rules-not-iterable", lambda s: Rules(5), RuleError, "5", "(logical_name, mesh_axes)"),
    C("rules-none-entry", lambda s: Rules([None]), RuleError, "rule #0", "None"),
    C("resolve-unknown-mesh-axis", lambda s: resolve(("batch",), [("batch", "dta")], {"data": 8}), RuleError,
      "'dta'", "{'data': 8}"),
    C("resolve-spec-longer-than-rank", lambda s: resolve(("a", "b"), [], {"data": 8}, (4,), path="enc/w"),
      RuleError, "'enc/w'", "rank 1", "(4,)"),
    C("resolve-non-str-name", lambda s: resolve((1,), [], {"data": 8}, path="w"), RuleError, "'w'", "1"),
    C("resolve-name-twice", lambda s: resolve(("embed", "embed"), [], {"data": 8}, path="w"), RuleError,
      "'embed'", "dimensions 0 and 1", "'w'"),
    C("resolve-strict-unknown-name", lambda s: resolve(("hidden",), Rules([("batch", "data")], strict=True),
                                                        {"data": 8}, (8,), path="mlp/w"),
      RuleError, "'hidden'", "'mlp/w'", "no rule"),
    C("resolve-strict-indivisible", lambda s: resolve(("batch",), Rules([("batch", "data")], strict=True),
                                                       {"data": 8}, (6,), path="x"),
      RuleError, "'x'", "size 6", "('data',)", "8"),
    C("resolve-strict-override", lambda s: resolve(("hidden",), [("batch", "data")], {"data": 8}, (8,),
                                                    path="h", strict=True), RuleError, "'hidden'", "'h'"),
    C("physical-longer-than-rank", lambda s: check_physical(P("data", None, None), {"data": 8}, (8, 8), path="w"),
      RuleError, "'w'", "rank 2"),
    C("physical-unknown-axis", lambda s: check_physical(P("modle"), {"data": 8}, (8,), path="w"), RuleError,
      "'modle'", "'w'"),
    C("physical-axis-twice", lambda s: check_physical(P("data", "data"), {"data": 8}, (8, 8), path="w"),
      RuleError, "'data'", "twice", "'w'"),
    C("physical-indivisible", lambda s: check_physical(P("data"), {"data": 8}, (6,), path="w"), RuleError,
      "size 6", "'w'", "('data',)"),
    C("path-rule-invalid-regex", lambda s: PathRules({"dense[": ("embed",)}), RuleError, "'dense['"),
    C("parallelize-rule-unknown-axis", lambda s: build(mesh=MESH, rules=[("batch", "dta")]), RuleError,
      "('batch', 'dta')", "'dta'", "{'data': 4, 'model': 2}"),
    C("parallelize-rules-malformed", lambda s: build(mesh=MESH, rules=[("batch",)]), RuleError, "rule #0"),
    C("parallelize-rules-not-iterable", lambda s: build(mesh=MESH, rules=7), RuleError, "7"),
    C("parallelize-path-rule-invalid-regex", lambda s: build(mesh=MESH, param_rules={"w(": ("embed",)}),
      RuleError, "'w('"),
    C("parallelize-path-rule-unknown-axis", lambda s: build(mesh=MESH, param_rules={"w": P("tensor", None)}),
      RuleError, "'tensor'", "'w'"),
    C("parallelize-path-rule-longer-than-rank", lambda s: build(mesh=MESH, param_rules={"b": P("data", None)}),
      RuleError, "'b'", "rank 1"),
    C("parallelize-path-rule-indivisible", lambda s: build(mesh=MESH, param_rules={"b": P("data")},
                                                           params=lambda: {"w": jnp.ones((16, 8)), "b": jnp.ones(6)},
                                                           fun=lambda p, b: jnp.sum(b["x"]) + jnp.sum(p["b"])),
      RuleError, "'b'", "size 6"),
    C("parallelize-strict-indivisible-param", lambda s: build(
        mesh={"data": 8}, rules=[("batch", "data"), ("mlp", "data")], param_rules={"b": ("mlp",)},
        params=lambda: {"w": jnp.ones((16, 8)), "b": jnp.ones(6)}, strict=True,
        fun=lambda p, b: jnp.sum(b["x"]) + jnp.sum(p["b"])), RuleError, "'b'", "size 6", "'mlp'"),
    C("parallelize-strict-unruled-param-name", lambda s: build(
        mesh=MESH, rules=[("batch", "data")], param_rules={"w": ("embed", "hidden")}, strict=True),
      RuleError, "'hidden'", "'w'"),
    C("constraint-unknown-mesh-axis", lambda s: build_and_call(
        lambda p, b: jnp.sum(with_sharding_constraint(b["x"] @ p["w"], P("batch", "mlp"))),
        mesh=MESH, rules=[("batch", "data"), ("mlp", "tensor")]), RuleError, "'tensor'", "('mlp', 'tensor')",
      "('batch', 'mlp')"),
    C("batch-indivisible-at-build", lambda s: build(batch=spmd_batch(10), mesh=MESH, rules=[("batch", "data")]),
      RuleError, "batch 'x'", "size 10", "('data',)"),
    C("batch-indivisible-stacked-axes", lambda s: build(batch=spmd_batch(12), mesh={"data": 4, "fsdp": 2},
                                                        rules=[("batch", "data"), ("batch", "fsdp")]),
      RuleError, "batch 'x'", "size 12", "('data', 'fsdp')"),
]

MESHES = [
    C("mesh-wrong-type", lambda s: build(mesh=[4, 2]), TypeError, "[4, 2]", "Mesh"),
    C("mesh-too-big", lambda s: build(mesh={"data": 16}), ValueError, "8 devices", "{'data': 16}", "16"),
    C("mesh-fewer-devices", lambda s: build(mesh=MESH, devices=D()[:6]), ValueError, "6 devices",
      "{'data': 4, 'model': 2}"),
    C("mesh-two-minus-ones", lambda s: build(mesh={"data": -1, "model": -1}), ValueError, "more than one -1"),
    C("mesh-size-zero", lambda s: build(mesh={"data": 0}), ValueError, "{'data': 0}", "below 1"),
    C("mesh-minus-one-not-dividing", lambda s: build_mesh({"data": 3, "model": -1}), ValueError,
      "{'data': 3, 'model': -1}", "8 devices"),
    C("mesh-empty-devices", lambda s: build(devices=[]), ValueError, "devices is empty"),
    C("mesh-repeated-devices", lambda s: build(devices=[D()[0], D()[0]]), ValueError, "more than once"),
    C("mesh-and-other-devices", lambda s: build(mesh=build_mesh(MESH), devices=D()[:4]), ValueError,
      "[0, 1, 2, 3, 4, 5, 6, 7]", "[0, 1, 2, 3]"),
    C("slice-mesh-unknown-axis", lambda s: slice_mesh(build_mesh(MESH), "stage"), ValueError, "'stage'",
      "{'data': 4, 'model': 2}"),
    C("mesh-size-float", lambda s: build(mesh={"data": 2.5}), TypeError, "'data'", "2.5", "int"),
    C("mesh-size-str", lambda s: build_mesh({"data": "8"}), TypeError, "'data'", "'8'"),
    C("devices-a-string", lambda s: build(devices="cpu"), TypeError, "'cpu'", "jax devices"),
    C("devices-unknown-id", lambda s: build(devices=[0, 99]), ValueError, "device id 99"),
    C("devices-not-devices", lambda s: build(devices=[D()[0], "gpu"]), TypeError, "'gpu'", "str"),
    C("place-mesh-axis-names", lambda s: place_mesh((2, 2), D()[:4], ("a",)), ValueError, "(2, 2)", "('a',)"),
]

PARALLELIZE = [
    C("fun-not-callable", lambda s: parallelize(3, init_params=spmd_params, initial_batch=spmd_batch()), TypeError,
      "got int"),
    C("init-params-missing", lambda s: parallelize(spmd_step, initial_batch=spmd_batch()), TypeError,
      "init_params=", "'spmd_step'"),
    C("init-params-a-dict", lambda s: parallelize(spmd_step, init_params={"w": 1}, initial_batch=spmd_batch()),
      TypeError, "init_params", "got dict"),
    C("init-params-needs-key", lambda s: parallelize(spmd_step, init_params=lambda key: key,
                                                     initial_batch=spmd_batch()),
      TypeError, "init_params", "['key']"),
    C("no-batch-source", lambda s: parallelize(spmd_step, init_params=spmd_params), TypeError,
      "get_input_batch=", "initial_batch="),
    C("both-batch-sources", lambda s: parallelize(spmd_step, init_params=spmd_params, initial_batch=spmd_batch(),
                                                  get_input_batch=spmd_batch), TypeError, "exactly one"),
    C("get-input-batch-needs-args", lambda s: parallelize(spmd_step, init_params=spmd_params,
                                                          get_input_batch=lambda n: n), TypeError,
      "get_input_batch", "['n']"),
    C("get-input-batch-an-array", lambda s: parallelize(spmd_step, init_params=spmd_params,
                                                        get_input_batch=np.ones(3)), TypeError,
      "get_input_batch", "ndarray"),
    C("fun-takes-one-argument", lambda s: build(one_arg), TypeError, "one_arg(p)", "fun(params, batch)"),
    C("fun-takes-keyword-only-batch", lambda s: build(keyword_batch), TypeError, "keyword_batch(p, *, b)"),
    C("init-params-returns-string", lambda s: build(params=lambda: {"w": jnp.ones(3), "tag": "v1"}), TypeError,
      "init_params", "leaf tag", "'v1'"),
    C("get-input-batch-returns-string", lambda s: parallelize(spmd_step, init_params=spmd_params,
                                                              get_input_batch=lambda: {"x": "text"}),
      TypeError, "get_input_batch", "leaf x", "str"),
    C("initial-batch-string-leaf", lambda s: build(batch={"x": np.ones((32, 16), F32), "note": "hi"}), TypeError,
      "initial_batch", "batch note", "'hi'"),
    C("rules-a-dict", lambda s: build(mesh=MESH, rules={"batch": "data"}), RuleError, "{'batch': 'data'}",
      "list(rules.items())"),
    C("step-returns-string", lambda s: build(returns(lambda p, b: ("done", jnp.sum(p["w"])))), TypeError,
      "'step_returning'", "output 0", "'done'"),
    C("step-returns-object-in-dict", lambda s: build(returns(lambda p, b: {"loss": jnp.sum(p["w"]),
                                                                          "note": object()})),
      TypeError, "'step_returning'", "output note", "object"),
    C("step-returns-string-with-extra-arg", lambda s: call_extra_arg(s), TypeError, "'step_with_extra'",
      "output 1"),
    C("call-params-missing-leaf", lambda s: s.spmd[0]({"w": s.spmd[1]()["w"]}, spmd_batch()), ValueError,
      "params", "missing: b"),
    C("call-params-extra-leaf", lambda s: call_spmd(s, extra=jnp.ones(3)), ValueError, "params", "unexpected: extra"),
    C("call-batch-missing-leaf", lambda s: call_spmd(s, batch={"y": np.ones((32, 16), F32)}), ValueError,
      "batch", "missing: x", "unexpected: y"),
    C("call-param-other-shape-broadcasts", lambda s: call_spmd(s, b=jnp.ones(1)), StepInputError,
      "'spmd_step'", "params leaf 'b'", "float32[8]", "float32[1]"),
    C("call-param-other-shape", lambda s: call_spmd(s, w=jnp.ones((16, 4))), StepInputError,
      "params leaf 'w'", "float32[16,8]", "float32[16,4]"),
    C("call-param-other-shape-indivisible", lambda s: call_spmd(s, w=np.ones((16, 3), F32)), StepInputError,
      "params leaf 'w'", "float32[16,3]"),
    C("call-params-on-other-mesh", lambda s: call_spmd(s, other_mesh_params(
        s, Mesh(np.array(D()).reshape(2, 4), ("data", "model")), P(None, "model"))), StepInputError,
      "params leaf 'w'", "{'data': 2, 'model': 4}", "{'data': 4, 'model': 2}", "param_shardings"),
    C("call-params-on-other-devices", lambda s: call_spmd(s, other_mesh_params(
        s, Mesh(np.array(D()[:4]), ("data",)))), StepInputError, "params leaf", "devices 0-3", "devices 0-7"),
    C("call-param-on-one-device", lambda s: call_spmd(s, w=jax.device_put(jnp.ones((16, 8)), D()[3])),
      StepInputError, "params leaf 'w'", "SingleDeviceSharding", "P(None, 'model')"),
    C("call-param-other-spec", lambda s: call_spmd(s, w=jax.device_put(
        jnp.ones((16, 8)), NamedSharding(build_mesh(MESH), P("data", None)))), StepInputError,
      "params leaf 'w'", "P('data', None)", "P(None, 'model')"),
    C("call-batch-indivisible", lambda s: call_spmd(s, batch=spmd_batch(10)), StepInputError,
      "batch leaf 'x'", "'spmd_step'", "(10, 16)", "multiple of 4"),
    C("call-batch-other-feature-size", lambda s: call_spmd(s, batch=spmd_batch(32, 4)), StepInputError,
      "batch leaf 'x'", "float32[32,16]", "float32[32,4]"),
    C("call-batch-other-rank", lambda s: call_spmd(s, batch={"x": np.ones((32,), F32)}), StepInputError,
      "batch leaf 'x'", "float32[32]"),
    C("call-batch-string-leaf", lambda s: call_spmd(s, batch={"x": "abc"}), StepInputError, "batch leaf 'x'",
      "str 'abc'"),
    C("call-donated-state-again", lambda s: reuse_donated(), DonatedArrayError, "'spmd_step'", "donate=True",
      "params leaf", "'w'", "donate=False"),
    C("call-deleted-not-donated", lambda s: call_deleted(s), DonatedArrayError, "'spmd_step'", "does not donate",
      "'w'"),
    C("call-deleted-batch", lambda s: call_deleted_batch(s), DonatedArrayError, "batch leaf", "'x'"),
    C("parallelize-step-mesh-list", lambda s: parallelize_step(None, optax.sgd(0.1), [4, 2], global_batch={}),
      TypeError, "mesh must be a jax.sharding.Mesh", "{axis: size} dict", "list"),
    C("parallelize-step-no-batch", lambda s: parallelize_step(None, optax.sgd(0.1), build_mesh(MESH)), TypeError,
      "global_batch=", "local_batch="),
    C("flax-task-not-a-module", lambda s: mmflax.task(spmd_step), TypeError, "Flax Linen Module", "spmd_step"),
    C("shard-map-no-out-specs", lambda s: shard_map(lambda x: x, mesh=build_mesh(MESH)), TypeError, "out_specs"),
    C("shard-map-check-vma-and-rep", lambda s: shard_map(lambda x: x, mesh=build_mesh(MESH), out_specs=P(),
                                                         check_vma=True, check_rep=True), TypeError,
      "check_vma", "check_rep"),
    C("shard-map-axis-names-and-auto", lambda s: shard_map(lambda x: x, mesh=build_mesh(MESH), out_specs=P(),
                                                           axis_names={"data"}, auto=frozenset({"model"})),
      TypeError, "axis_names", "auto"),
]


def one_arg(p):
    return jnp.sum(p["w"])


def keyword_batch(p, *, b):
    return jnp.sum(p["w"])


def call_extra_arg(sh: Shared):
    def step_with_extra(p, b, scale):
        return jnp.sum(p["w"]) * scale, "text"

    step, init = build(step_with_extra, mesh=MESH, rules=[("batch", "data")])
    return step(init(), spmd_batch(), 2.0)


def call_deleted(sh: Shared):
    step, init = sh.spmd
    p = init()
    p["w"].delete()
    return step(p, spmd_batch())


def call_deleted_batch(sh: Shared):
    step, init = sh.spmd
    b = jax.device_put(spmd_batch(), step.batch_shardings)
    b["x"].delete()
    return step(init(), b)


def _double(x):
    return 2 * x


def task_given_donated_state():
    """A task called eagerly with a state a donating step freed (JAX: "Array has been deleted ...")."""
    step, init = build(mesh=MESH, rules=[("batch", "data")], donate=True)
    state = init()
    step(state, spmd_batch())
    return task(lambda p: jax.tree.map(_double, p), "double", devices=D()[:4])(state)


def nested_tasks():
    inner = task(_double, "inner", devices=D()[4:])
    return task(lambda x: inner(x) + 1, "outer", devices=D()[:4])(jnp.ones(4))


def pipeline_with_stages(num_stages):
    def step(state, b):
        stages = _stages()

        def loss(p, mb):
            return jnp.sum(stages[1](p["s1"], stages[0](p["s0"], mb["x"])))

        return microbatch(lambda p, mb: jax.grad(loss)(p, mb), 0, 4, argnum=1, num_stages=num_stages)(state, b)

    return parallelize(step, init_params=pipeline_params, get_input_batch=pipeline_batch)


def pipeline_scheduled(schedule="1f1b", *, interleave=None, pipelines=1, same_call=False):
    """`pipeline_step`'s chain (stage0 -> stage1, once per microbatch) microbatched ``pipelines`` times in one
    step (``same_call``: one microbatched function called again, else one `microbatch` call each)."""
    def loss(p, mb):
        stages = _stages()
        return jnp.sum(stages[1](p["s1"], stages[0](p["s0"], mb["x"])))

    def step(state, b):
        grads = microbatch(jax.grad(loss), 0, 4, argnum=1, schedule=schedule, interleave=interleave)
        total = grads(state, b)
        for _ in range(pipelines - 1):
            again = grads if same_call else microbatch(jax.grad(loss), 0, 4, argnum=1, schedule=schedule,
                                                       interleave=interleave)
            total = jax.tree.map(jnp.add, total, again(state, b))
        return total

    return parallelize(step, init_params=pipeline_params, get_input_batch=pipeline_batch)


def task_returning(value, *, traced: bool):
    stage = task(lambda w, x: (jnp.tanh(x @ w), value), "odd_stage", devices=D()[:4])
    if not traced:  # called eagerly: runs on its submesh at once
        return stage(jnp.ones((16, 16)), jnp.ones((8, 16)))
    return parallelize(lambda p, b: jnp.sum(stage(p["s0"], b["x"])[0]), init_params=pipeline_params,
                       get_input_batch=pipeline_batch)


TASKS = [
    C("task-mesh-and-devices", lambda s: task(_double, "t", mesh=build_mesh(MESH), devices=D()[:2]), ValueError,
      "task 't'", "mesh=", "devices="),
    C("task-device-axes-count", lambda s: task(_double, "t", devices=D()[:4], device_axes=("a", "b")), ValueError,
      "task 't'", "(4,)", "('a', 'b')"),
    C("task-2d-devices-one-axis", lambda s: task(_double, "t", devices=np.array(D()[:4]).reshape(2, 2),
                                                 device_axes=("a",)), ValueError, "task 't'", "(2, 2)", "('a',)"),
    C("task-logical-axes-without-axes", lambda s: task(_double, "t", logical_axes=[("batch", "devices")]),
      ValueError, "task 't'", "logical_axes="),
    C("task-device-axes-without-devices", lambda s: task(_double, "t", device_axes=("a", "b")), ValueError,
      "task 't'", "('a', 'b')"),
    C("task-repeated-devices", lambda s: task(_double, "rep", devices=[D()[0], D()[0]]), ValueError,
      "task 'rep'", "[0]", "more than once"),
    C("task-unknown-device-id", lambda s: task(_double, "ids", devices=[0, 99]), ValueError, "task 'ids'",
      "device id 99"),
    C("task-empty-devices", lambda s: task(_double, "none", devices=[]), ValueError, "task 'none'",
      "devices=[] is empty", "at least one device"),
    C("task-empty-device-array", lambda s: task(_double, "none", devices=np.empty((0, 2), object),
                                                device_axes=("a", "b")), ValueError, "task 'none'", "is empty"),
    C("register-empty-devices", lambda s: register_task("blk", devices=[]), ValueError, "'blk'", "is empty"),
    C("task-given-donated-state", lambda s: task_given_donated_state(), DonatedArrayError, "task 'double'",
      "deleted array(s): argument 0 leaf 'b', argument 0 leaf 'w'", "donate=True", "the state it returned"),
    C("task-device-a-string", lambda s: task(_double, "bad", devices=["cpu"]), TypeError, "task 'bad'", "'cpu'"),
    C("task-logical-axes-a-dict", lambda s: task(_double, "t", devices=D()[:4], device_axes=("x",),
                                                 logical_axes={"batch": "x"}), RuleError, "{'batch': 'x'}"),
    C("task-logical-axes-malformed", lambda s: task(_double, "t", devices=D()[:4], device_axes=("x",),
                                                    logical_axes=[("batch",)]), RuleError, "rule #0"),
    C("task-inside-task-other-devices", lambda s: nested_tasks(), ValueError, "task 'inner'", "task 'outer'",
      "devices [4-7]", "devices [0-3]"),
    C("microbatch-size-zero", lambda s: microbatch(_double, 0, 0), ValueError, "size", "got 0"),
    C("microbatch-size-float", lambda s: microbatch(_double, 0, 2.5), ValueError, "size", "2.5"),
    C("microbatch-unknown-schedule", lambda s: microbatch(_double, 0, 2, schedule="zigzag"), ValueError,
      "'zigzag'", "gpipe", "1f1b"),
    C("microbatch-schedule-wrong-type", lambda s: microbatch(_double, 0, 2, schedule=5), ValueError, "got 5",
      "gpipe"),
    C("microbatch-interleave-with-gpipe", lambda s: microbatch(_double, 0, 2, schedule="gpipe", interleave=2),
      ValueError, "interleave", "'interleaved'"),
    C("microbatch-argnum-a-name", lambda s: microbatch(_double, 0, 2, argnum="x"), TypeError, "argnum", "'x'"),
    C("microbatch-dim-a-float", lambda s: microbatch(_double, 0.0, 2), TypeError, "dim", "0.0"),
    C("microbatch-size-not-dividing", lambda s: microbatch(_double, 0, 3)(jnp.ones((8, 2))), ValueError,
      "microbatch(_double)", "size 8", "size 3"),
    C("microbatch-dim-out-of-range", lambda s: microbatch(_double, 2, 2)(jnp.ones((8, 2))), ValueError,
      "microbatch(_double)", "dim 2", "(8, 2)"),
    C("microbatch-argnum-out-of-range", lambda s: microbatch(_double, 0, 2, argnum=3)(jnp.ones(8)), ValueError,
      "microbatch(_double)", "argnum=3", "1 arguments"),
    C("microbatch-no-arrays", lambda s: microbatch(_double, 0, 2)({}), ValueError, "microbatch(_double)",
      "no arrays"),
    C("microbatch-leaves-disagree", lambda s: microbatch(lambda t: t["a"], 0, 2)({"a": jnp.ones(8), "b": jnp.ones(4)}),
      ValueError, "different numbers of microbatches", "[2, 4]"),
    C("microbatch-num-stages-mismatch", lambda s: pipeline_with_stages(3), ValueError, "num_stages=3", "2 stages"),
    C("microbatch-interleaved-on-a-one-pass-chain", lambda s: pipeline_scheduled("interleaved"), ValueError,
      "microbatch(loss)", "schedule='interleaved'", "2 chunks", "stage0 -> stage1 visits each submesh once",
      "stage0 -> stage1 -> stage0 -> stage1", "schedule='1f1b'"),
    C("microbatch-interleave-2-on-a-one-pass-chain", lambda s: pipeline_scheduled("interleaved", interleave=2),
      ValueError, "microbatch(loss)", "schedule='interleaved'", "2 chunks", "visits each submesh once",
      "schedule='1f1b'"),
    C("microbatch-interleave-3-on-a-one-pass-chain", lambda s: pipeline_scheduled("interleaved", interleave=3),
      ValueError, "microbatch(loss)", "3 chunks", "visits each submesh once",
      "stage0 -> stage1 -> stage0 -> stage1 -> stage0 -> stage1"),
    C("microbatch-two-pipelines-in-one-step", lambda s: pipeline_scheduled(pipelines=2), ValueError,
      "one step may hold one microbatch pipeline", "found 2", "microbatch(loss), microbatch(loss)",
      "separate steps"),
    C("microbatch-one-pipeline-called-twice", lambda s: pipeline_scheduled(pipelines=2, same_call=True), ValueError,
      "one step may hold one microbatch pipeline", "found 2"),
    C("task-returns-string", lambda s: task_returning("done", traced=True), TypeError, "task 'odd_stage'",
      "output 1: str 'done'", "jnp.asarray"),
    C("task-returns-object-eagerly", lambda s: task_returning({"note": object()}, traced=False), TypeError,
      "task 'odd_stage'", "output 1/note: object", "outside the task"),
    C("schedule-unknown-name", lambda s: get_schedule("foo", 2, 4), ValueError, "'foo'", "gpipe"),
    C("schedule-zero-stages", lambda s: get_schedule("gpipe", 0, 4), ValueError, "num_stages", "0"),
    C("schedule-negative-microbatches", lambda s: get_schedule("1f1b", 2, -1), ValueError, "num_microbatches", "-1"),
    C("schedule-interleave-and-chunks", lambda s: get_schedule("interleaved", 2, 4, interleave=2, num_chunks=2),
      ValueError, "'interleave'", "'num_chunks'"),
    C("schedule-instance-mismatch", lambda s: get_schedule(get_schedule("gpipe", 2, 4), 4, 4), ValueError,
      "'gpipe'", "num_stages=2", "num_stages=4"),
    C("schedule-chunks-on-1f1b", lambda s: get_schedule("1f1b", 2, 4, num_chunks=2), ValueError, "num_chunks",
      "'1f1b'"),
    C("schedule-wrong-type", lambda s: get_schedule(3.5, 2, 4), ValueError, "3.5"),
    C("mpmd-param-other-shape", lambda s: call_mpmd(s, params=lambda p: {**p, "s1": jnp.ones((16, 8))}),
      StepInputError, "'pipeline_step'", "params leaf 's1'", "float32[16,16]", "float32[16,8]"),
    C("mpmd-batch-other-size", lambda s: call_mpmd(s, batch=pipeline_batch(16)), StepInputError,
      "'pipeline_step'", "batch leaf 'x'", "float32[8,16]", "float32[16,16]"),
    C("mpmd-params-missing-leaf", lambda s: call_mpmd(s, params=lambda p: {"s0": p["s0"]}), ValueError,
      "params", "missing: s1"),
    C("mpmd-donated-state-again", lambda s: reuse_donated(s, mpmd=True), DonatedArrayError, "'pipeline_step'",
      "donate=True", "params leaf"),
    C("mpmd-step-returns-string", lambda s: parallelize(
        returns(lambda p, b: (_stages()[0](p["s0"], b["x"]), "text")), init_params=pipeline_params,
        get_input_batch=pipeline_batch), TypeError, "'step_returning'", "output 1"),
]

REGISTER = [
    C("register-invalid-regex", lambda s: register_task("layers_(", devices=D()[:4]), ValueError, "'layers_('",
      "regular expression"),
    C("register-regex-not-str", lambda s: register_task(5, devices=D()[:4]), ValueError, "regex=5"),
    C("register-callback-and-devices", lambda s: register_task("a", callback=lambda m, b: None, devices=D()[:2]),
      ValueError, "register_task('a')", "callback="),
    C("register-callback-not-callable", lambda s: register_task("a", callback=3), TypeError,
      "register_task('a')", "callback", "3"),
    C("register-mesh-and-devices", lambda s: register_task("blk", mesh=build_mesh(MESH), devices=D()[:2]),
      ValueError, "'blk'", "mesh="),
    C("register-device-axes-count", lambda s: register_task("blk", devices=D()[:4], device_axes=("a", "b")),
      ValueError, "'blk'", "('a', 'b')"),
    C("register-unknown-device-id", lambda s: register_task("blk", devices=[0, 42]), ValueError, "'blk'",
      "device id 42"),
    C("register-repeated-devices", lambda s: register_task("blk", devices=[1, 1]), ValueError, "'blk'", "[1]"),
    C("register-matches-nothing-strict", lambda s: with_registration(r"layer_\d+", strict=True, devices=D()[:4]),
      ValueError, "['layer_\\\\d+']", "blk_0"),
    C("register-callback-returns-junk", lambda s: with_callback("junk"), ValueError, r"register_task('blk_(\\d+)')",
      "'junk'", "'blk_0'"),
    C("register-callback-range-too-big", lambda s: with_callback(((4, 12), "late")), ValueError, "'blk_0'",
      "4..11", "8 devices"),
    C("register-callback-dims-mismatch", lambda s: with_callback(((0, 4), "st"), dims=(3,)), ValueError,
      "dims=(3,)", "'blk_0'", "(4)"),
    C("register-callback-repeated-devices", lambda s: with_callback(([D()[0], D()[0]], "st")), ValueError,
      "'blk_0'", "[0, 0]", "more than once"),
    C("register-callback-not-devices", lambda s: with_callback((["a", "b"], "st")), ValueError, "'blk_0'",
      "'a' is a str"),
]

def deleted_state() -> dict:
    """A state whose ``w`` was freed, as a step built with donate=True frees the state it is given."""
    state = ckpt_state()
    state["w"].delete()
    return state


def second_writer(directory: str) -> None:
    """Two managers saving to one directory: the second one is refused."""
    first = CheckpointManager(directory)
    first.save(1, ckpt_state())
    try:
        CheckpointManager(directory).save(2, ckpt_state())
    finally:
        first.close()


def self_referencing() -> dict:
    meta = {"config": {"lr": 1e-3}}
    meta["config"]["parent"] = meta
    return meta


CHECKPOINTS = [
    C("ckpt-max-to-keep-zero", lambda s: CheckpointManager(s.tmp("k"), max_to_keep=0), ValueError,
      "max_to_keep", "0"),
    C("ckpt-max-to-keep-bool", lambda s: CheckpointManager(s.tmp("kb"), max_to_keep=True), TypeError,
      "max_to_keep", "True (bool)"),
    C("ckpt-save-deleted-leaf", lambda s: save(s.tmp("del"), 0, deleted_state()), ValueError, "deleted", "w",
      "donate=True"),
    C("ckpt-save-second-writer", lambda s: second_writer(s.tmp("two")), CheckpointSaveError,
      "checkpoint step 2", "another writer holds the directory", f"pid {os.getpid()}", ".multimesh-writer.lock",
      "close the other CheckpointManager"),
    C("ckpt-save-metadata-contains-itself", lambda s: mgr(s).save(5, ckpt_state(), metadata=self_referencing()),
      ValueError, "metadata['config']['parent']", "contains itself"),
    C("ckpt-restore-empty-dir", lambda s: CheckpointManager(s.tmp("empty")).restore(target=ckpt_target()),
      FileNotFoundError, "no complete checkpoint", "empty"),
    C("ckpt-restore-missing-dir-read-only", lambda s: CheckpointManager(
        os.path.join(s.tmp("gone"), "no_such_dir"), read_only=True).restore(target=ckpt_target()),
      FileNotFoundError, "no_such_dir", "no complete checkpoint"),
    C("ckpt-restore-missing-step", lambda s: restore(s, 7), FileNotFoundError, "step 7", "complete steps: [1]"),
    C("ckpt-restore-step-negative", lambda s: restore(s, -2), ValueError, "step", "-2"),
    C("ckpt-restore-step-str", lambda s: restore(s, "1"), TypeError, "step must be an int", "str"),
    C("ckpt-restore-no-target", lambda s: mgr(s).restore(1, target=None), TypeError, "target=",
      "abstract_params"),
    C("ckpt-restore-target-without-sharding", lambda s: restore(s, 1, ckpt_target(
        w=jax.ShapeDtypeStruct((8, 8), jnp.float32))), TypeError, "w (ShapeDtypeStruct without a sharding)"),
    C("ckpt-restore-target-numpy-leaf", lambda s: restore(s, 1, ckpt_target(b=np.ones(8, F32))), TypeError,
      "b (ndarray)"),
    C("ckpt-restore-target-missing-leaf", lambda s: restore(s, 1, ckpt_target(b=None)), CheckpointMismatchError,
      "missing from target", "b"),
    C("ckpt-restore-target-extra-leaf", lambda s: restore(s, 1, ckpt_target(
        extra=jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(ckpt_mesh(), P())))),
      CheckpointMismatchError, "unexpected in target", "extra"),
    C("ckpt-restore-target-other-shape", lambda s: restore(s, 1, ckpt_target(
        w=jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(ckpt_mesh(), P())))),
      CheckpointMismatchError, "shape mismatch at w", "(8, 8)", "(8, 4)"),
    C("ckpt-restore-target-other-dtype", lambda s: restore(s, 1, ckpt_target(
        b=jax.ShapeDtypeStruct((8,), jnp.int32, sharding=NamedSharding(ckpt_mesh(), P())))),
      CheckpointMismatchError, "mismatch at b", "int32"),
    C("ckpt-save-existing-step", lambda s: save(s.ckpt, 1, ckpt_state()), CheckpointExistsError,
      "step 1 already exists", "delete(1)"),
    C("ckpt-save-python-int-leaf", lambda s: save(s.tmp("int"), 0, {**ckpt_state(), "count": 3}), TypeError,
      "count (int)"),
    C("ckpt-save-numpy-leaf", lambda s: save(s.tmp("np"), 0, {**ckpt_state(), "host": np.ones(3)}), TypeError,
      "host (ndarray)"),
    C("ckpt-save-empty-state", lambda s: save(s.tmp("nothing"), 0, {}), ValueError, "no leaves"),
    C("ckpt-save-negative-step", lambda s: save(s.tmp("neg"), -1, ckpt_state()), ValueError, "step", "-1"),
    C("ckpt-save-read-only", lambda s: mgr(s, read_only=True).save(2, ckpt_state()), PermissionError,
      "read-only", "ckpt"),
    C("ckpt-delete-missing-step", lambda s: mgr(s).delete(9), FileNotFoundError, "step 9"),
    C("ckpt-info-missing-step", lambda s: mgr(s).info(4), FileNotFoundError, "step 4", "[1]"),
    C("ckpt-directory-deleted-under-a-reader", lambda s: deleted_under_reader(s, "directory"), FileNotFoundError,
      "the checkpoint directory", "deleted", "is gone", "after this CheckpointManager listed step 1"),
    C("ckpt-step-deleted-under-a-reader", lambda s: deleted_under_reader(s, "step"), FileNotFoundError,
      "step 1's directory", "deleted", "is gone"),
    C("ckpt-closed-manager", lambda s: closed_manager(s), RuntimeError, "closed", "ckpt"),
    C("ckpt-step-without-metadata", lambda s: corrupt_meta(s), CheckpointCorruptError, "step 3", "'multimesh'"),
    C("ckpt-abstract-target-not-a-sharding", lambda s: abstract_target({"w": jnp.ones(2)}, {"w": P()}),
      TypeError, "jax.sharding.Sharding", "`shardings`"),
]


def _ce():
    return _config_error()


CONFIGS = [
    C("cli-unknown-section", lambda s: cli("model2.x=1", "--print-config"), CliFailed, "exit 2", "'model2.x'",
      "did you mean 'model'"),
    C("cli-unknown-key", lambda s: cli("optimizer.lrr=1", "--print-config"), CliFailed, "optimizer.lrr",
      "did you mean 'lr'"),
    C("cli-wrong-type", lambda s: cli("train.steps=abc", "--print-config"), CliFailed, "train.steps", "int",
      "'abc'"),
    C("cli-steps-zero", lambda s: cli("train.steps=0", "--print-config"), CliFailed, "train", "steps", "0"),
    C("cli-override-without-equals", lambda s: cli("tiny", "train.steps", "--print-config"), CliFailed,
      "'train.steps'", "key.sub=value"),
    C("cli-stray-word-after-overrides", lambda s: cli("train.steps=1", "foo", "--print-config"), CliFailed,
      "'foo'", "key=value"),
    C("cli-unknown-config", lambda s: cli("nosuch", "--print-config"), CliFailed, "'nosuch'", "tiny"),
    C("cli-bad-yaml-value", lambda s: cli("layout.mesh={data: 8", "--print-config"), CliFailed, "layout.mesh",
      "YAML"),
    C("cli-empty-key-component", lambda s: cli("train..steps=1", "--print-config"), CliFailed, "train..steps",
      "empty component"),
    C("cli-bad-decay", lambda s: cli("optimizer.decay=exp", "--print-config"), CliFailed, "optimizer",
      "decay='exp'"),
    C("cli-unknown-on-nonfinite", lambda s: cli("train.on_nonfinite=ignore", "--print-config"), CliFailed,
      "exit 2", "on_nonfinite='ignore'", "'stop', 'warn'"),
    C("cli-mesh-size-zero", lambda s: cli("layout.mesh={data: 0}", "--print-config"), CliFailed, "layout",
      "'data'", "0"),
    C("cli-unknown-rule-set", lambda s: cli("layout.rules=fancy", "--print-config"), CliFailed, "layout",
      "'fancy'", "standard"),
    C("cli-rule-unknown-mesh-axis", lambda s: cli("layout.rules=[[batch, nope]]", "--print-config"), CliFailed,
      "layout", "'nope'"),
    C("cli-pipeline-one-stage", lambda s: cli("pipeline", "layout.pipeline.stages=1", "--print-config"), CliFailed,
      "layout.pipeline", "stages", "1"),
    C("cli-microbatches-not-dividing", lambda s: cli("pipeline", "layout.pipeline.microbatches=3",
                                                     "--print-config"),
      CliFailed, "layout.pipeline.microbatches=3", "data.batch_size=16"),
    C("cli-pipeline-unknown-schedule", lambda s: cli("pipeline", "layout.pipeline.schedule=zb", "--print-config"),
      CliFailed, "layout.pipeline", "'zb'", "1f1b"),
    C("cli-seq-len-too-long", lambda s: cli("data.seq_len=512", "--print-config"), CliFailed, "data.seq_len=512",
      "model.max_len=128"),
    C("cli-vocab-too-small", lambda s: cli("model.vocab_size=100", "--print-config"), CliFailed,
      "model.vocab_size=100"),
    C("cli-heads-not-dividing", lambda s: cli("model.num_heads=3", "--print-config"), CliFailed, "model",
      "num_heads=3", "d_model=128"),
    C("cli-unknown-dtype", lambda s: cli("model.dtype=float17", "--print-config"), CliFailed, "model",
      "dtype='float17'", "'float32', 'bfloat16'"),
    C("cli-integer-dtype", lambda s: cli("model.dtype=int32", "--print-config"), CliFailed, "exit 2",
      "model: dtype='int32'", "floating-point", "'float32', 'bfloat16', 'float16'"),
    C("cli-integer-param-dtype", lambda s: cli("model.param_dtype=int8", "--print-config"), CliFailed, "exit 2",
      "param_dtype='int8'", "'float32'"),
    C("cli-num-processes-zero", lambda s: cli("--num-processes", "0"), CliFailed, "--num-processes", ">= 1"),
    C("cli-processes-without-coordinator", lambda s: cli("--num-processes", "2", "train.steps=1"), CliFailed,
      "--coordinator", "--process-id"),
    C("cli-coordinator-without-num-processes", lambda s: cli("--coordinator", "127.0.0.1:1", "train.steps=1"),
      CliFailed, "exit 2", "--coordinator 127.0.0.1:1", "--num-processes N"),
    C("cli-process-id-without-num-processes", lambda s: cli("--process-id", "1", "train.steps=1"), CliFailed,
      "exit 2", "--process-id 1", "--num-processes N"),
    C("cli-startup-timeout-zero", lambda s: cli("--startup-timeout", "0", "train.steps=1"), CliFailed, "exit 2",
      "--startup-timeout", ">= 1"),
    C("distributed-coordinator-not-host-port", lambda s: _initialize("host0", 2, 1), ValueError, "'host0'",
      "HOST:PORT"),
    C("distributed-coordinator-unresolvable", lambda s: _initialize("nohost.invalid:5000", 2, 1), StartupError,
      "'nohost.invalid'", "does not resolve", "process 1"),
    C("cli-unknown-flag", lambda s: cli("--fast"), CliFailed, "exit 2", "--fast"),
    C("cli-sample-without-run", lambda s: cli("sample"), CliFailed, "exit 2", "--run"),
    C("cli-sample-negative-tokens", lambda s: cli("sample", "--run", "x", "--tokens", "-1"), CliFailed,
      "--tokens", ">= 0"),
    C("cli-sample-run-without-checkpoints", lambda s: cli("sample", "--run", os.path.join(s.tmp("run"), "nope")),
      FileNotFoundError, "nope", "checkpoints/", "train.out_dir"),
    C("config-file-bad-yaml", lambda s: load(config=config_file(s, "model: [1,\n")), _ce, "c.yaml",
      "not valid YAML"),
    C("config-file-not-a-mapping", lambda s: load(config=config_file(s, "- 1\n- 2\n")), _ce, "c.yaml", "mapping",
      "list"),
    C("config-file-unknown-top-key", lambda s: load(config=config_file(s, "base: tiny\nmodle: {}\n")), _ce,
      "'modle'", "did you mean 'model'"),
    C("config-file-base-cycle", lambda s: load(config=cycle_config(s)), _ce, "cycle", "a.yaml", "b.yaml"),
    C("config-file-base-not-a-name", lambda s: load(config=config_file(s, "base: 5\n")), _ce, "base", "5"),
    C("config-section-not-a-mapping", lambda s: load(config=config_file(s, "base: tiny\nmodel: 3\n")), _ce,
      "model", "3"),
    C("config-missing-pipeline-key", lambda s: load("layout.pipeline={stages: 2}"), _ce,
      "layout.pipeline.microbatches"),
    C("config-resume-not-bool", lambda s: load("train.resume=maybe"), _ce, "train.resume", "'maybe'"),
    C("config-name-empty", lambda s: from_dict({"name": ""}), _ce, "name", "''"),
    C("config-override-into-a-value", lambda s: load("train.steps.x=1"), _ce, "train.steps", "not a mapping"),
]

# A config that does not fit its batch, its data, the devices or its out_dir: exit 2, before anything compiles.
# What the config alone decides fails --print-config; what needs this machine fails --plan and training.
FITS = [
    C("cli-mesh-not-dividing-batch", lambda s: cli("layout.mesh={data: 3}", "--print-config"), CliFailed,
      "exit 2", "layout.mesh={data: 3}", "('data',)", "data.batch_size=16", "multiple of 3"),
    C("cli-mesh-more-devices-plan", lambda s: cli("layout.mesh={data: 16}", "--plan", out_dir(s)), CliFailed,
      "exit 2", "layout.mesh={data: 16}", "16 devices", "this run has 8", "--plan --num-devices 16"),
    C("cli-mesh-more-devices-train", lambda s: cli("layout.mesh={data: 16}", "train.steps=1", out_dir(s)),
      CliFailed, "exit 2", "layout.mesh={data: 16}", "16 devices", "this run has 8", "device_count=16"),
    C("cli-pipeline-more-devices-plan", lambda s: cli("pipeline", "layout.mesh={data: 8}", "--plan", out_dir(s)),
      CliFailed, "exit 2", "layout.mesh={data: 8} x layout.pipeline.stages=2", "16 devices", "per pipeline stage"),
    C("cli-batch-size-zero", lambda s: cli("data.batch_size=0", "--print-config"), CliFailed, "exit 2",
      "data.batch_size=0", "at least 1"),
    C("cli-seq-len-zero", lambda s: cli("data.seq_len=0", "--print-config"), CliFailed, "exit 2",
      "data.seq_len=0", "at least 1"),
    C("cli-val-fraction-zero", lambda s: cli("data.val_fraction=0", "--print-config"), CliFailed, "exit 2",
      "data.val_fraction=0.0", "between 0 and 1"),
    C("cli-val-fraction-one", lambda s: cli("data.val_fraction=1", "--print-config"), CliFailed, "exit 2",
      "data.val_fraction=1.0"),
    C("cli-max-bytes-below-one-validation-batch", lambda s: cli("data.max_bytes=4000", "--print-config"), CliFailed,
      "exit 2", "data.max_bytes=4000", "validation split of 200 bytes", "1 window(s)", "needs 4",
      "raise data.max_bytes"),
    C("cli-max-bytes-below-one-training-batch", lambda s: cli("data.max_bytes=20000", "data.batch_size=256",
                                                              "--print-config"), CliFailed,
      "exit 2", "data.max_bytes=20000", "training split", "data.batch_size=256"),
    C("cli-corpus-smaller-than-max-bytes", lambda s: cli(f"data.paths=[{small_corpus(s)}]", "train.steps=1",
                                                         out_dir(s)), CliFailed,
      "exit 2", "the corpus (3,000 bytes", "data.paths", "validation split", "add text to data.paths"),
    C("cli-state-over-the-memory-limit", lambda s: with_memory_limit("1MiB", lambda: cli("train.steps=1", out_dir(s))),
      CliFailed, "exit 2", "the train state (", "M parameters and their optimizer state) does not fit",
      "the host has 1.0 MiB ($MULTIMESH_MEMORY_LIMIT)", "short", "no layout on this host holds it",
      "--num-processes"),
    C("cli-state-copied-over-the-memory-limit", lambda s: with_memory_limit(
        "20MiB", lambda: cli("train.steps=1", out_dir(s))), CliFailed, "exit 2", "does not fit", "20.0 MiB",
      "shard it over the host's devices instead of copying it to each", "layout.mesh={data: 8}"),
    C("memory-limit-not-a-size", lambda s: with_memory_limit("ten gigs", lambda: cli("train.steps=1", out_dir(s))),
      CliFailed, "MULTIMESH_MEMORY_LIMIT='ten gigs'", "10GiB"),
    C("state-over-each-devices-memory", lambda s: state_over_device_memory(), ValueError, "the state does not fit",
      "device 0 holds 64.0 KiB of it", "each device holds 32.0 KiB (as given)", "32.0 KiB short"),
    C("cli-out-dir-a-file-plan", lambda s: cli("--plan", f"train.out_dir={a_file(s)}"), CliFailed, "exit 2",
      "train.out_dir=", "a_file'", "is an existing file"),
    C("cli-out-dir-a-file-train", lambda s: cli("train.steps=1", f"train.out_dir={a_file(s)}"), CliFailed,
      "exit 2", "train.out_dir=", "a_file'", "is an existing file"),
    C("cli-out-dir-under-a-file", lambda s: cli("train.steps=1", f"train.out_dir={a_file(s)}/run"), CliFailed,
      "exit 2", "a_file/run'", "lies under", "an existing file"),
]


def with_memory_limit(limit: str, run: Callable[[], object]) -> object:
    """``run()`` with ``MULTIMESH_MEMORY_LIMIT`` set to ``limit`` (the memory the state is checked against)."""
    before = os.environ.get("MULTIMESH_MEMORY_LIMIT")
    os.environ["MULTIMESH_MEMORY_LIMIT"] = limit
    try:
        return run()
    finally:
        if before is None:
            del os.environ["MULTIMESH_MEMORY_LIMIT"]
        else:
            os.environ["MULTIMESH_MEMORY_LIMIT"] = before


def state_over_device_memory():
    """A state of 8 x 64 KiB float32 rows sharded over 8 devices, each device said to hold 32 KiB."""
    from multimesh.estimate.memory import MemoryLimit, check_state_fits

    state = {"w": jax.ShapeDtypeStruct((8, 16384), jnp.float32, sharding=NamedSharding(build_mesh({"d": 8}), P("d")))}
    check_state_fits(state, what="the state", limit=MemoryLimit(2**15, True, "as given"))


def out_dir(sh: Shared) -> str:
    return f"train.out_dir={sh.tmp('run')}/run"


def a_file(sh: Shared) -> str:
    path = os.path.join(sh.tmp("out"), "a_file")
    open(path, "w").close()
    return path


def small_corpus(sh: Shared) -> str:
    path = os.path.join(sh.tmp("corpus"), "small.py")
    with open(path, "w") as f:
        f.write("x = 1\n" * 500)  # 3,000 bytes: validation gets 150, not one window of 129 per batch shard
    return path

CASES = RULES + MESHES + PARALLELIZE + TASKS + REGISTER + CHECKPOINTS + CONFIGS + FITS


def test_the_table_is_large_and_ids_are_unique():
    assert len(CASES) >= 120, len(CASES)
    assert len({c.id for c in CASES}) == len(CASES)


def _task_with_rules_for_a_missing_axis():
    return task(_double, "t", devices=D()[:4], device_axes=("x",), logical_axes=[("batch", "y")])


def _registration_with_rules_for_a_missing_axis():
    with register_task("blk", devices=D()[:4], device_axes=("x",), logical_axes=[("batch", "data")]):
        pass


@pytest.mark.parametrize("make,names", [
    (_task_with_rules_for_a_missing_axis, ("('batch', 'y')", "'y'", "{'x': 4}")),
    (_registration_with_rules_for_a_missing_axis, ("('batch', 'data')", "'data'", "{'x': 4}")),
], ids=["task", "register_task"])
def test_a_stage_rule_for_a_missing_axis_is_named_in_a_warning(make, names):
    """A stage's rule naming a mesh axis its mesh lacks warns (as MultiMesh allows it) until an array uses it."""
    with pytest.warns(RuleWarning) as record:
        make()
    message = str(record[0].message)
    assert all(n in message for n in names), message


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_named(case: Case, shared: Shared):
    error = case.error if isinstance(case.error, type) else case.error()
    with pytest.raises(error) as info:
        case.make(shared)
    message = str(info.value)
    missing = [n for n in case.names if n not in message]
    assert not missing, f"{case.id}: {type(info.value).__name__} message lacks {missing}:\n{message}"


# ---------------------------------------------------------------------------------------------------------------
# Focused: failures that are easy to leave silent or obscure
# ---------------------------------------------------------------------------------------------------------------


def test_a_parameter_of_another_shape_that_would_broadcast_is_refused_not_run(shared):
    step, init = shared.spmd
    good = init()
    with pytest.raises(StepInputError, match=r"params leaf 'b': built for float32\[8\], given float32\[1\]"):
        step({**good, "b": jnp.ones(1)}, spmd_batch())  # (32, 8) + (1,) broadcasts: it used to run
    loss, new = step(good, spmd_batch())  # the step still works with the right state
    np.testing.assert_allclose(float(loss), 32 * 8 * (16 + 1))
    assert new["w"].sharding == step.param_shardings["w"]


def test_donated_state_reused_names_the_step_and_the_fix():
    step, init = build(mesh=MESH, rules=[("batch", "data")], donate=True)
    state = init()
    _, new = step(state, spmd_batch())
    assert state["w"].is_deleted()  # donation happened: the error below is about that
    with pytest.raises(DonatedArrayError) as info:
        step(state, spmd_batch())
    assert "'spmd_step'" in str(info.value) and "loss, state = step(state, batch)" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)  # JAX's "Array has been deleted" is kept as the cause
    loss2, _ = step(new, spmd_batch())  # feeding back the returned state works
    np.testing.assert_allclose(float(loss2), 32 * 8 * (16 * 0.5 + 1))


def test_state_laid_out_for_another_mesh_lists_every_leaf_and_device_put_fixes_it(shared):
    step, _ = shared.spmd
    other = other_mesh_params(shared, Mesh(np.array(D()).reshape(2, 4), ("data", "model")), P(None, "model"))
    with pytest.raises(StepInputError) as info:
        step(other, spmd_batch())
    text = str(info.value)
    assert "params leaf 'w' is laid out as P(None, 'model') on mesh {'data': 2, 'model': 4}" in text
    assert "the step expects P(None, 'model') on mesh {'data': 4, 'model': 2}" in text
    assert "params leaf 'b'" not in text  # replicated on the same devices either way: no mismatch to report
    fixed = jax.device_put(other, step.param_shardings)  # the fix the message gives
    loss, _ = step(fixed, spmd_batch())
    np.testing.assert_allclose(float(loss), 32 * 8 * (16 + 1))


def test_batch_that_does_not_divide_at_call_time_names_leaf_and_divisor(shared):
    step, init = shared.spmd
    batch = {"x": np.ones((10, 16), F32)}
    with pytest.raises(StepInputError, match=r"batch leaf 'x' of step 'spmd_step' has shape \(10, 16\) \(built for "
                                             r"float32\[32,16\]\): dimension 0 \(size 10\) does not divide over mesh "
                                             r"axes \('data',\) \(4 devices\)"):
        step(init(), batch)
    loss, _ = step(init(), {"x": np.ones((8, 16), F32)})  # another batch size that divides: allowed, retraced
    np.testing.assert_allclose(float(loss), 8 * 8 * (16 + 1))


def test_mpmd_pipeline_checks_shapes_and_donation(shared):
    step, init, get_batch = shared.mpmd
    with pytest.raises(StepInputError, match=r"params leaf 's0': built for float32\[16,16\], given float32\[8,16\]"):
        step({**init(), "s0": jnp.ones((8, 16))}, get_batch())
    with pytest.raises(StepInputError, match=r"step 'pipeline_step' .*batch leaf 'x': built for float32\[8,16\], "
                                             r"given float32\[6,16\]"):
        step(init(), {"x": jnp.ones((6, 16)), "y": jnp.zeros((6, 16))})  # the plan is for 2 microbatches of 4
    state = init()
    loss, new = step(state, get_batch())
    with pytest.raises(DonatedArrayError, match=r"step 'pipeline_step' was built with donate=True"):
        step(state, get_batch())
    loss2, _ = step(new, get_batch())
    assert np.isfinite(float(loss)) and float(loss2) < float(loss)


def test_step_returning_a_string_names_the_users_function():
    def my_train_step(p, b):
        return jnp.sum(p["w"]), {"status": "ok"}

    with pytest.raises(TypeError) as info:
        build(my_train_step, mesh=MESH, rules=[("batch", "data")])
    text = str(info.value)
    assert "step 'my_train_step'" in text and "output 1/status: str 'ok'" in text
    assert "traced" not in re.sub(r"my_train_step", "", text)  # no internal wrapper named


def test_devices_may_be_integer_ids():
    step, init = build(devices=[4, 5, 6, 7], mesh={"data": 4}, rules=[("batch", "data")])
    assert [d.id for d in step.mesh.devices.flat] == [4, 5, 6, 7]
    assert init()["w"].sharding.device_set == set(D()[4:])


def test_mpmd_state_on_other_devices_is_moved_to_its_stages_not_refused(shared):
    """A pipeline step moves inputs to each stage's submesh itself: a state laid out elsewhere (here all on
    device 0) gives the same numbers, and the state it returns is on the stages' submeshes."""
    step, init, get_batch = shared.mpmd
    elsewhere = jax.device_put(init(), D()[0])
    loss, new = step(elsewhere, get_batch())
    want, _ = step(init(), get_batch())
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    for name, stage in zip(("s0", "s1"), _stages()):
        assert new[name].sharding.device_set == set(stage.placement.mesh.devices.flat)


@pytest.mark.parametrize("overrides, key", [
    (["layout.mesh={data: 16}"], "layout.mesh={data: 16}"),
    (["data.paths=[CORPUS]"], "data.paths"),
    (["train.out_dir=FILE"], "is an existing file"),
])
def test_a_config_that_does_not_fit_is_refused_before_the_step_is_built(shared, monkeypatch, overrides, key):
    import trainers.train

    def built(*args, **kwargs):
        raise AssertionError("the step was built (traced and compiled) before the config was refused")

    monkeypatch.setattr(trainers.train, "build_program", built)
    given = [o.replace("CORPUS", small_corpus(shared)).replace("FILE", a_file(shared)) for o in overrides]
    with pytest.raises(CliFailed, match=r"^exit 2: multimesh-train: config error: ") as info:
        cli(out_dir(shared), "train.steps=1", *given)
    assert key in str(info.value)


def test_the_cli_refuses_a_mesh_larger_than_the_machine_in_one_line_within_seconds(tmp_path):
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo), "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "trainers", "layout.mesh={data: 16}", "train.steps=1",
                           f"train.out_dir={tmp_path / 'run'}"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    took = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "config error: layout.mesh={data: 16} needs 16 devices, but this run has 8" in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert took < 60, f"{took:.0f} s: the refusal must come before anything compiles"


def test_a_task_takes_keyword_arguments_as_it_takes_positional_ones():
    """Keyword arguments reach the task's function, traced and differentiated like positional ones: a pipeline
    whose stages are called with them gives the one-device losses, gradients and parameters."""
    from helpers import check_mpmd_against_reference

    first = task(lambda w, x, *, scale: jnp.tanh(x @ w) * scale, "kw_first", devices=D()[:4])
    second = task(_stage, "kw_second", devices=D()[4:])

    def loss(p, mb):
        h = first(p["s0"], x=mb["x"], scale=jnp.float32(0.5))  # a keyword-only argument and a named positional
        return jnp.sum((second(w=p["s1"], x=h) - mb["y"]) ** 2) / 8  # a parameter given by keyword

    def step(state, b):
        value, g = microbatch(jax.value_and_grad(loss), 0, 4, argnum=1, schedule="1f1b")(state, b)
        return value, g, jax.tree.map(lambda p, d: p - 0.1 * d, state, g)

    fn, _ = check_mpmd_against_reference(step, pipeline_params, lambda: {"x": jnp.ones((8, 16)),
                                                                          "y": jnp.full((8, 16), 0.3)}, steps=2)
    assert sorted(p.name for p in fn.plan.placements) == ["kw_first", "kw_second"]
    w, x = jnp.full((16, 16), 0.1), jnp.ones((8, 16))
    eager = second(w=w, x=x)  # outside parallelize: runs on its submesh
    np.testing.assert_allclose(eager, _stage(w, x), rtol=1e-6)
    assert eager.sharding.device_set == set(D()[4:])
