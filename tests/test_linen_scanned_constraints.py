"""Every Flax sharding constraint of a MaxText-style scanned decoder kept under `parallelize`.

The model is written as MaxText writes its decoder: ``nn.scan`` over an
``nn.remat``'d layer (a checkpoint policy, ``variable_axes={"params": 0}``,
``split_rngs``, ``metadata_params={nn.PARTITION_NAME: "layers"}``), activations
hinted with ``nn.with_logical_constraint`` in attention, MLP and residuals
(inside the scanned body and outside it), parameters boxed by
``nn.with_logical_partitioning``. MaxText itself cannot be imported here: its
layers import aqt, qwix and tokamax, which are not installed.

The reference for the constraints is the model's own ``jax.jit`` with its mesh
in context and Flax's rules (``nn.logical_axis_rules``), as MaxText runs its
train step; counted as ``sharding_constraint`` equations in the jaxpr, nested
ones (scan, remat) included, each with its array type and spec. The reference
for the values is the same step on one device.
"""

from __future__ import annotations

import collections
import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import partitioning as nn_partitioning
from helpers import norm_spec
from jax.ad_checkpoint import checkpoint_name

from multimesh.core.jaxprs import subjaxprs
from multimesh.core.placement import use_placement
from multimesh.jax import build_mesh, parallelize, register_task
from multimesh.plan.programs import run_program
from multimesh.trace.constraints import resolve_deferred

pytestmark = pytest.mark.devices(8)

VOCAB, EMBED, HEADS, KV, MLP, LAYERS = 32, 16, 4, 4, 32, 4
BATCH, LENGTH = 8, 8
MESH = {"data": 2, "fsdp": 2, "sequence": 1, "tensor": 2}
ACTIVATION = ("activation_batch", "activation_length", "activation_embed")
HEAD_ACTIVATION = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
RULES = [  # MaxText's names, and its habit of several mesh axes for the batch
    ("activation_batch", ("data", "fsdp")),
    ("activation_heads", "tensor"),
    ("activation_length", "sequence"),
    ("activation_embed", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_kv", None),
    ("activation_vocab", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("norm", None),
    ("layers", None),
]


def _kernel(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class DenseGeneral(nn.Module):
    """MaxText's DenseGeneral in short: a kernel of its full shape, named by logical axes."""

    shape: tuple
    names: tuple
    equation: str

    @nn.compact
    def __call__(self, x):
        return jnp.einsum(self.equation, x, self.param("kernel", _kernel(self.names), self.shape))


class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        def projection(name):
            return DenseGeneral((EMBED, HEADS, KV), ("embed", "heads", "kv"), "bld,dhk->blhk", name=name)

        q = nn.with_logical_constraint(projection("query")(x), HEAD_ACTIVATION)
        k = nn.with_logical_constraint(projection("key")(x), HEAD_ACTIVATION)
        v = nn.with_logical_constraint(projection("value")(x), HEAD_ACTIVATION)
        q = checkpoint_name(q, "query_proj")
        weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / KV ** 0.5)
        out = nn.with_logical_constraint(jnp.einsum("bhqk,bkhd->bqhd", weights, v), HEAD_ACTIVATION)
        out = DenseGeneral((HEADS, KV, EMBED), ("heads", "kv", "embed"), "blhk,hkd->bld", name="out")(out)
        return checkpoint_name(out, "out_proj")


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(MLP, use_bias=False, kernel_init=_kernel(("embed", "mlp")), name="wi")(x)
        h = nn.with_logical_constraint(nn.gelu(h), ("activation_batch", "activation_length", "activation_mlp"))
        return nn.Dense(EMBED, use_bias=False, kernel_init=_kernel(("mlp", "embed")), name="wo")(h)


class DecoderLayer(nn.Module):
    @nn.compact
    def __call__(self, inputs, deterministic):
        inputs = checkpoint_name(nn.with_logical_constraint(inputs, ACTIVATION), "decoder_layer_input")
        lnx = nn.with_logical_constraint(RMSNorm(name="pre_attention_norm")(inputs), ACTIVATION)
        attention = nn.with_logical_constraint(Attention(name="self_attention")(lnx), ACTIVATION)
        h = nn.with_logical_constraint(attention + inputs, ACTIVATION)
        mlp = nn.with_logical_constraint(Mlp(name="mlp")(RMSNorm(name="post_attention_norm")(h)), ACTIVATION)
        return nn.with_logical_constraint(mlp + h, ACTIVATION), None


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, tokens, deterministic=True):
        embed = nn.Embed(VOCAB, EMBED, name="token_embedder",
                         embedding_init=nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")))
        y = nn.with_logical_constraint(embed(tokens), ACTIVATION)
        policy = jax.checkpoint_policies.save_only_these_names("query_proj", "out_proj")
        layer = nn.remat(DecoderLayer, prevent_cse=False, policy=policy, static_argnums=(2,))
        stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=(nn.broadcast,),
                        length=LAYERS, metadata_params={nn.PARTITION_NAME: "layers"})
        y, _ = stack(name="layers")(y, deterministic)
        y = nn.with_logical_constraint(RMSNorm(name="decoder_norm")(y), ACTIVATION)
        return nn.with_logical_constraint(embed.attend(y), ("activation_batch", "activation_length",
                                                            "activation_vocab"))


model = Decoder()
tx = optax.adam(1e-2)
TOKENS = np.random.RandomState(0).randint(0, VOCAB, (BATCH, LENGTH))


def init_boxed():
    """The parameters as ``model.init`` gives them: boxed, which Flax constrains where each is read."""
    return model.init(jax.random.key(0), jnp.asarray(TOKENS))


def init_unboxed():
    """The parameters unboxed, as MaxText hands them to its train step."""
    return nn.unbox(init_boxed())


def get_batch():
    return {"tokens": jnp.asarray(TOKENS)}


def loss_fn(params, batch):
    logits = model.apply(params, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"]).mean()


def step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return loss, grads, optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])


Key = tuple[str, str, tuple]  # (the primitives it is nested in, its array type, its spec)


def spec_of(sharding: jax.sharding.NamedSharding) -> tuple:
    """The spec, less mesh axes of one device (which JAX may or may not keep: they change nothing)."""
    sizes = dict(sharding.mesh.shape)
    kept = [tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if sizes[a] > 1) for e in sharding.spec]
    return norm_spec(jax.sharding.PartitionSpec(*[e[0] if len(e) == 1 else (e or None) for e in kept]))


def constraints(jaxpr, where: str = "") -> collections.Counter[Key]:
    """Every sharding constraint of ``jaxpr``, nested ones included."""
    found: collections.Counter[Key] = collections.Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            found[(where, eqn.invars[0].aval.str_short(), spec_of(eqn.params["sharding"]))] += 1
        for inner in subjaxprs(eqn):
            found += constraints(inner, f"{where}/{eqn.primitive.name}")
    return found


def lowered_constraints(lowered) -> int:
    """Sharding custom calls in the HLO the step compiles."""
    return len(re.findall(r'custom_call_target="Sharding"', lowered.as_text(dialect="hlo")))


def own_jit(init):
    """The model's own ``jax.jit`` of its step, with its mesh and Flax's rules in context, as MaxText runs it."""
    params = init()
    with jax.set_mesh(build_mesh(MESH)), nn_partitioning.axis_rules(RULES):
        traced = jax.jit(step).trace(params, get_batch())
        return constraints(traced.jaxpr.jaxpr), lowered_constraints(traced.lower())


def built(init, how: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rules for names only the unboxed parameters' paths would carry
        if how == "rules=":
            return parallelize(step, init_params=init, get_input_batch=get_batch, mesh=MESH, rules=RULES)
        with nn_partitioning.axis_rules(RULES):
            extra = {"rules": RULES} if how == "context and rules=" else {}
            return parallelize(step, init_params=init, get_input_batch=get_batch, mesh=MESH, **extra)


@pytest.mark.parametrize("init,how", [(init_boxed, "rules="), (init_boxed, "context and rules="),
                                      (init_unboxed, "context")], ids=["boxed-rules", "boxed-both", "unboxed-context"])
def test_every_constraint_of_the_model_own_jit_is_kept(init, how):
    want, want_lowered = own_jit(init)
    nested = {k: n for k, n in want.items() if k[0]}
    assert sum(nested.values()) >= 30 and any("/scan/remat" in k[0] for k in nested)
    fn, init_p, get_b = built(init, how)
    traced = fn.trace(init_p(), get_b())
    got = constraints(traced.jaxpr.jaxpr)
    # inside the scan and the remat: the very same constraints; at the top, multimesh adds its output layouts
    assert {k: n for k, n in got.items() if k[0]} == nested
    assert not {k: n - got[k] for k, n in want.items() if got[k] < n}
    assert lowered_constraints(traced.lower()) >= want_lowered == sum(want.values())


def test_boxed_parameters_are_constrained_where_they_are_read():
    """Flax constrains a boxed parameter when a module reads it under a mesh: the scanned layer's slice,
    by its names less the layer axis; under the remat again, where the backward pass reads it."""
    want, _ = own_jit(init_boxed)
    slice_of_wi = ("/scan", f"float32[{EMBED},{MLP}]", ("fsdp", "tensor"))
    assert want[slice_of_wi] == 1
    fn, init_p, get_b = built(init_boxed, "rules=")
    assert constraints(fn.trace(init_p(), get_b()).jaxpr.jaxpr)[slice_of_wi] == 1


STEPS = 3


def trained(step_fn, state, batch) -> list:
    """(loss, grads, parameters) after each of `STEPS` steps."""
    out = []
    for _ in range(STEPS):
        loss, grads, state = step_fn(state, batch)
        out.append(jax.device_get((loss, grads, state)))
    return out


@functools.cache
def one_device() -> list:
    return trained(jax.jit(step), jax.device_put(init_boxed(), jax.devices()[0]), get_batch())


def largest_difference(got: list, want: list) -> float:
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
               zip(jax.tree.leaves(got), jax.tree.leaves(want)))


@functools.cache
def tolerance() -> float:
    """The larger of 1e-4 and twice the model's own jit's difference from one device (Adam turns the order
    in which a sharded gradient is summed into differences of about 1e-4 in the parameters)."""
    with jax.set_mesh(build_mesh(MESH)), nn_partitioning.axis_rules(RULES):
        own = trained(jax.jit(step), init_boxed(), get_batch())
    return max(1e-4, 2 * largest_difference(own, one_device()))


def assert_trains_as_one_device(step_fn, state) -> None:
    got = trained(step_fn, state, get_batch())
    np.testing.assert_allclose([float(g[0]) for g in got], [float(w[0]) for w in one_device()], rtol=1e-5)
    assert largest_difference(got, one_device()) <= tolerance()


@pytest.mark.slow  # one of the longest checks: the default suite's time
def test_spmd_trains_equal_to_one_device():
    fn, init_p, _ = built(init_boxed, "rules=")
    assert_trains_as_one_device(fn, init_p())


def program_constraints(fn) -> dict[str, collections.Counter[Key]]:
    """The constraints each MPMD program imposes (deferred ones resolved), by its submesh's devices."""
    found: dict[str, collections.Counter[Key]] = collections.defaultdict(collections.Counter)
    for program in fn.runtime.programs:
        literals = [jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
                    for v in program.literal_values(program.segments[0])]
        with use_placement(program.placement):
            jaxpr = jax.make_jaxpr(run_program(program, resolve_deferred))(*program.jaxpr.in_avals, *literals)
        found[program.placement.name] += constraints(jaxpr.jaxpr)
    return found


PIPELINE_MESH = {"data": 2, "fsdp": 2, "tensor": 2}
STAGES = {(0, 2): ((0, 4), "stage0"), (2, 4): ((4, 8), "stage1")}


def test_pipeline_stage_lacking_a_mesh_axis_keeps_its_constraints_and_warns():
    """Stages of {data, tensor} (no fsdp) given no rules of their own: the step's rules resolve each hint
    there, without fsdp, which a warning names; the stages train equal to one device."""
    with register_task(r"layers", split=STAGES, dims=(2, 2), device_axes=("data", "tensor")), \
            warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn, init_p, _ = parallelize(step, init_params=init_boxed, get_input_batch=get_batch, mesh=PIPELINE_MESH,
                                    rules=[r for r in RULES if r[0] != "activation_length"])
        assert_trains_as_one_device(fn, init_p())
    messages = [str(w.message) for w in record]
    assert not [m for m in messages if "gathered" in m]  # the stack stays split: no stage copies another's layers
    lacking = [m for m in messages if "lacks mesh axis 'fsdp'" in m]
    assert any(m.startswith(f"nn.with_logical_constraint(x, {HEAD_ACTIVATION}) on float32[8,8,4,4] runs on stage")
               and "'activation_batch' -> 'fsdp'" in m for m in lacking), lacking
    on = program_constraints(fn)
    hidden = (f"float32[{BATCH},{LENGTH},{EMBED}]", ("data", None, "tensor"))
    for stage in ("stage0", "stage1"):  # each stage's layers keep their hints, resolved on its submesh
        assert sum(n for (where, *k), n in on[stage].items() if where.startswith("/scan") and tuple(k) == hidden) >= 6


def test_pipeline_stage_with_its_own_rules_does_not_warn():
    rules = [(n, tuple(a for a in ((m,) if isinstance(m, str) else m or ()) if a != "fsdp") or None)
             for n, m in RULES if n != "activation_length"]
    with register_task(r"layers", split=STAGES, dims=(2, 2), device_axes=("data", "tensor"), logical_axes=rules):
        fn, init_p, _ = parallelize(step, init_params=init_boxed, get_input_batch=get_batch, mesh=PIPELINE_MESH,
                                    rules=rules)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lacks mesh ax")
        assert_trains_as_one_device(fn, init_p())
    assert program_constraints(fn)["stage0"]


class PartitionedModel(nn.Module):
    """A kernel boxed with mesh axes (`nn.with_partitioning`), as nanodo writes its FSDP."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(MLP, use_bias=False,
                        kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("fsdp", "tensor")))(x)


def test_a_box_of_mesh_axes_is_constrained_as_flax_does_under_a_mesh():
    x = jnp.ones((BATCH, EMBED))
    params = PartitionedModel().init(jax.random.key(0), x)

    def apply(p, b):
        return jnp.sum(PartitionedModel().apply(p, b["x"]))

    kernel = (f"float32[{EMBED},{MLP}]", ("fsdp", "tensor"))
    with jax.set_mesh(build_mesh(MESH)):
        want = constraints(jax.make_jaxpr(apply)(params, {"x": x}).jaxpr)
    assert want[("", *kernel)] == 1
    fn, init_p = parallelize(apply, init_params=lambda: params, initial_batch={"x": x}, mesh=MESH)
    got = constraints(fn.trace(init_p(), {"x": x}).jaxpr.jaxpr)
    assert got[("", *kernel)] == 1


class NamedShardingHints(nn.Module):
    """MaxText's current helpers: ``NamedSharding(mesh, nn.logical_to_mesh_axes(names))`` on the model's own
    mesh, applied by `jax.lax.with_sharding_constraint`; the names resolved by the rules Flax sees."""

    mesh: jax.sharding.Mesh

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(MLP, use_bias=False, kernel_init=_kernel(("embed", "mlp")))(x)
        names = ("activation_batch", "activation_length", "activation_mlp")
        return jax.lax.with_sharding_constraint(h, jax.sharding.NamedSharding(self.mesh, nn.logical_to_mesh_axes(names)))


def test_the_model_own_logical_to_mesh_axes_resolves_by_the_rules_given():
    mesh = build_mesh(MESH)
    hinted = NamedShardingHints(mesh)
    x = jnp.ones((BATCH, LENGTH, EMBED))
    params = hinted.init(jax.random.key(0), x)

    def apply(p, b):
        return jnp.sum(hinted.apply(p, b["x"]))

    activation = (f"float32[{BATCH},{LENGTH},{MLP}]", (("data", "fsdp"), None, "tensor"))
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(RULES):
        assert constraints(jax.make_jaxpr(apply)(params, {"x": x}).jaxpr)[("", *activation)] == 1
    fn, init_p = parallelize(apply, init_params=lambda: params, initial_batch={"x": x}, mesh=MESH, rules=RULES)
    assert constraints(fn.trace(init_p(), {"x": x}).jaxpr.jaxpr)[("", *activation)] == 1
