"""Public Flax/JAX model code, unmodified, through multimesh's public API.

The models under ``tests/thirdparty/`` are vendored byte for byte from their
repositories (each folder's README names the repository, commit, path and
licence). They are adapted only here: imported from their folders, given tiny
configs, and trained the way a new user would, following README.md and the
guides in docs/:

* ``flax_lm1b``: Flax's examples/lm1b ``TransformerLM`` (Linen, logical names
  through ``nn.with_logical_partitioning``);
* ``flax_wmt``: Flax's examples/wmt encoder-decoder ``Transformer`` (Linen, no
  sharding metadata: named by path rules, ``param_rules``);
* ``nanodo``: Google DeepMind's nanodo ``TransformerDo`` (Linen FSDP: mesh axis
  ``"data"`` in ``nn.with_partitioning``; a tied embedding, ``embed.attend``);
* ``flax_gemma``: Flax's examples/gemma ``Transformer`` (NNX, JAX's
  explicit-sharding style: ``out_sharding`` metadata and activation
  ``out_sharding=`` on an Explicit mesh under ``jax.set_mesh``; a tied embedding);
* ``flax_on_pjit``: the ``LogicalMLP`` of Flax's guide "Scale up Flax Modules on
  multiple devices" (Linen, ``nn.scan`` layer stack, ``nn.with_logical_constraint``),
  run from the page's own code cells.

For each model: SPMD (``parallelize`` on 8 devices), a pipeline (``register_task``
patterns placing the layers on 2 stages of 4 devices, ``microbatch`` under 1F1B;
the guide's model, whose constraint names its own 8-device mesh, one block per stage) and a
checkpoint saved on one layout and restored onto another; and the users' own
state objects (a flax TrainState, an nnx.Optimizer). Every result (3 optimizer
steps: losses, parameters and optimizer state) equals the same step on one
device (plain ``jax.jit``, no mesh), and shardings are checked on the real
arrays. Cases that fail because of the library are strict xfails naming the
limitation, so they flag when it is fixed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import re
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import guide_cells
from jax.sharding import AxisType, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from vendored import import_or_skip

from multimesh.checkpoint import CheckpointManager, abstract_target
from multimesh.jax import build_mesh, microbatch, parallelize, register_task
from multimesh.trace.implicit import is_backprop, scope_names

pytestmark = pytest.mark.devices(8)

THIRDPARTY = Path(__file__).resolve().parent / "thirdparty"
BATCH, LENGTH, VOCAB = 16, 8, 32
MICROBATCHES = 4
SAVE_AT, STEPS = 3, 5  # every run takes 3 steps; a restored checkpoint continues to step 5
TX = optax.adam(1e-2)


# ----------------------------------------------------------------- importing the vendored code
def _load_file(name: str, path: Path) -> types.ModuleType:
    """A single-file module imported under a unique name (two vendored files are ``models.py``,
    and the repository has a ``models`` package of its own); a skip saying why if it does not import."""
    if name not in sys.modules:
        import_or_skip(f"tests/{path.relative_to(THIRDPARTY.parent)}", lambda: _exec_file(name, path))
    return sys.modules[name]


def _exec_file(name: str, path: Path) -> None:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # no half-imported module for the next test
        raise


def _import_flat(folder: Path, names: Sequence[str]) -> dict[str, types.ModuleType]:
    """Import modules that import each other as top-level names (``import layers``), as the
    Gemma example does, without leaving those generic names in ``sys.modules`` (``helpers``
    is also this test suite's own module). ``jaxtyping``, used there only for the ``Array``
    annotation, is stood in by ``jax.Array`` when it is not installed."""
    stub = {}
    if importlib.util.find_spec("jaxtyping") is None:
        stub["jaxtyping"] = types.SimpleNamespace(Array=jax.Array)
    shadowed = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.modules.update(stub)
    sys.path.insert(0, str(folder))
    try:
        return import_or_skip(f"tests/thirdparty/{folder.name}", lambda: {n: importlib.import_module(n) for n in names})
    finally:
        sys.path.remove(str(folder))
        for n in (*names, *stub):
            sys.modules.pop(n, None)
        sys.modules.update(shadowed)


@functools.cache
def _nanodo() -> types.ModuleType:
    sys.path.insert(0, str(THIRDPARTY / "nanodo"))
    try:
        return import_or_skip("tests/thirdparty/nanodo",  # it imports `from nanodo import fsdp`
                              lambda: importlib.import_module("nanodo.model"))
    finally:
        sys.path.remove(str(THIRDPARTY / "nanodo"))


@functools.cache
def _t5x() -> types.ModuleType:
    """T5X's ``network.py`` imports ``from t5x.examples.t5 import layers``: the two files as those modules,
    under stand-in parent packages (T5X's own ``__init__`` imports its trainer and data pipeline)."""
    for package in ("t5x", "t5x.examples", "t5x.examples.t5"):
        if package not in sys.modules:
            sys.modules[package] = types.ModuleType(package)
            sys.modules[package].__path__ = []
    sys.modules["t5x.examples.t5"].layers = _load_file("t5x.examples.t5.layers", THIRDPARTY / "t5x_t5" / "layers.py")
    return _load_file("t5x.examples.t5.network", THIRDPARTY / "t5x_t5" / "network.py")


@functools.cache
def _gemma() -> dict[str, types.ModuleType]:
    return _import_flat(THIRDPARTY / "flax_gemma", [
        "params", "transformer_cfg", "positional_embeddings", "layers", "sow_lib", "helpers", "modules",
        "transformer"])


# ----------------------------------------------------------------- the common program
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Summed over tokens and divided by the GLOBAL token count, so that microbatches add up.
    One-hot, as the Gemma example's train.py writes it (an integer gather has no unambiguous
    output sharding on an Explicit mesh)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.sum(jax.nn.one_hot(targets, VOCAB) * log_probs) / (BATCH * targets.shape[1])


def get_batch() -> dict[str, jax.Array]:
    """Tokens in [1, VOCAB): 0 is padding for the Flax examples' attention masks."""
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"inputs": jax.random.randint(k1, (BATCH, LENGTH), 1, VOCAB),
            "targets": jax.random.randint(k2, (BATCH, LENGTH), 1, VOCAB)}


def make_step(loss: Callable, microbatches: int | None = None) -> Callable:
    """The one-device training step; with ``microbatches``, the loss is summed over them (1F1B)."""
    def step(state, batch):
        fn = loss if microbatches is None else microbatch(
            loss, 0, BATCH // microbatches, argnum=1, schedule="1f1b")
        value, grads = jax.value_and_grad(fn)(state["params"], batch)
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return value, {"params": optax.apply_updates(state["params"], updates), "opt": opt}
    return step


def train_state(params: Any) -> dict:
    return {"params": params, "opt": TX.init(params)}


def initializer(make_params: Callable[[jax.Array], Any]) -> Callable[[], dict]:
    """The train state's initializer, from parameters made once, on one device, and kept on the
    host (with their Linen boxes or NNX variables, so their sharding metadata): what `parallelize`
    compiles then returns constants instead of running the model's random initializers again for
    every layout. On CPU those initializers cost more compile time than the training step of such
    tiny models; made here eagerly with the cheap "rbg" generator (every run starts from these
    same values, so which generator made them does not matter)."""
    params = jax.device_get(make_params(jax.random.key(0, impl="rbg")))
    return lambda: train_state(jax.tree.map(jnp.asarray, params))


@dataclasses.dataclass(frozen=True)
class Model:
    """A vendored model as a user sets it up: its loss and state, its SPMD layout (``spmd``:
    `parallelize` keywords) and its 2-stage pipeline (``stages``: one `register_task` pattern
    per stage, each stage on 4 devices as ``stage_mesh`` with ``stage_rules``; ``stage_params``:
    the top-level parameter subtrees each stage must hold)."""

    name: str
    init: Callable[[], dict]
    loss: Callable[[Any, dict], jax.Array]
    spmd: dict
    stages: tuple[str, str] | None = None
    stage_mesh: dict | None = None
    stage_params: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    stage_rules: tuple = ()
    batch: Callable[[], dict] = get_batch
    param_rules: dict | None = None
    #: the one-device program, where it differs (Gemma: the same model without sharding)
    reference_init: Callable[[], dict] | None = None
    reference_loss: Callable[[Any, dict], jax.Array] | None = None
    #: a context around building and running the parallel steps (Gemma: jax.set_mesh)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    #: the rules of the model's own jit (its SPMD mesh in context, these rules in Flax's), whose difference
    #: from one device sets the parameters' tolerance: the larger of 1e-4 and twice it (else 1e-5)
    own_jit_rules: tuple | None = None


def lm1b() -> Model:
    models = _load_file("thirdparty_flax_lm1b_models", THIRDPARTY / "flax_lm1b" / "models.py")
    config = models.TransformerConfig(
        vocab_size=VOCAB, output_vocab_size=VOCAB, emb_dim=16, num_heads=2, num_layers=2, qkv_dim=16,
        mlp_dim=32, max_len=LENGTH, dropout_rate=0.0, attention_dropout_rate=0.0, deterministic=True)
    model = models.TransformerLM(config)

    def loss(params, batch):  # TransformerLM shifts its inputs right: logits[t] predicts inputs[t]
        return cross_entropy(model.apply(params, batch["inputs"]), batch["inputs"])

    rules = (("batch", "data"), ("mlp", "model"), ("kv", "model"), ("vocab", "model"))
    return Model(
        "flax_lm1b",
        init=initializer(lambda key: model.init(key, jnp.ones((1, LENGTH), jnp.int32))),
        loss=loss,
        spmd={"mesh": {"data": 4, "model": 2}, "rules": rules},
        stages=(r"Embed_0|posembed_output|encoderdecoderblock_0",
                r"encoderdecoderblock_1|encoderdecoder_norm|logitdense"),
        stage_mesh={"data": 2, "model": 2}, stage_rules=rules,
        stage_params=(("decoder/Embed_0", "decoder/encoderdecoderblock_0"),
                      ("decoder/encoderdecoderblock_1", "decoder/encoderdecoder_norm", "decoder/logitdense")))


def wmt() -> Model:
    models = _load_file("thirdparty_flax_wmt_models", THIRDPARTY / "flax_wmt" / "models.py")
    config = models.TransformerConfig(  # one encoder and one decoder layer: a stage each
        vocab_size=VOCAB, output_vocab_size=VOCAB, emb_dim=16, num_heads=2, num_layers=1, qkv_dim=16,
        mlp_dim=32, max_len=LENGTH, dropout_rate=0.0, attention_dropout_rate=0.0, deterministic=True)
    model = models.Transformer(config)

    def loss(params, batch):  # the decoder shifts its targets right
        return cross_entropy(model.apply(params, batch["inputs"], batch["targets"]), batch["targets"])

    rules = (("batch", "data"), ("mlp", "model"), ("heads", "model"))
    # no metadata in this model: its parameters are named by path (Megatron-style MLP and heads)
    param_rules = {r"MlpBlock_0/Dense_0/kernel$": (None, "mlp"), r"MlpBlock_0/Dense_0/bias$": ("mlp",),
                   r"MlpBlock_0/Dense_1/kernel$": ("mlp", None),
                   r"(query|key|value)/kernel$": (None, "heads", None), r"out/kernel$": ("heads", None, None)}
    one = jnp.ones((1, LENGTH), jnp.int32)
    return Model(
        "flax_wmt",
        init=initializer(lambda key: model.init(key, one, one)),
        loss=loss,
        spmd={"mesh": {"data": 4, "model": 2}, "rules": rules, "param_rules": param_rules},
        stages=(r"encoder", r"decoder"),
        stage_mesh={"data": 2, "model": 2}, stage_rules=rules, param_rules=param_rules,
        stage_params=(("encoder",), ("decoder",)))


def nanodo() -> Model:
    nd = _nanodo()
    model = nd.TransformerDo(nd.DoConfig(D=16, H=2, L=LENGTH, N=2, V=VOCAB, F=32))

    def loss(params, batch):  # next-token prediction
        tokens = batch["inputs"]
        return cross_entropy(model.apply(params, tokens)[:, :-1], tokens[:, 1:])

    return Model(
        "nanodo",
        init=initializer(lambda key: model.init(key, jnp.ones((1, LENGTH), jnp.int32))),
        loss=loss,
        spmd={"mesh": {"data": 8}, "rules": (("batch", "data"),)},   # its FSDP: parameters over "data"
        # the tied embedding: its lookup on stage 0, its logits (Linen's scope "embed.attend",
        # which the pattern "embed" also matches) registered with the last stage, as
        # docs/implicit-tasks.md says: the table is read on both stages
        stages=(r"embed|pos_embed|blocks_0", r"embed\.attend|blocks_1|out_ln"),
        stage_mesh={"data": 4}, stage_rules=(("batch", "data"),),
        stage_params=(("embed", "pos_embed", "blocks_0"), ("blocks_1", "out_ln")))


def gemma() -> Model:
    g = _gemma()
    cfg, tf = g["transformer_cfg"], g["transformer"]
    from flax import nnx

    def config(sharding):
        return cfg.TransformerConfig(
            num_layers=2, num_embed=VOCAB, embed_dim=16, hidden_dim=32, num_heads=2, head_dim=8, num_kv_heads=1,
            final_logit_softcap=None, use_post_attn_norm=True, use_post_ffw_norm=True,
            attention_types=(cfg.AttentionType.GLOBAL,) * 2, shd_config=sharding)

    def program(config):
        with nnx.use_eager_sharding(False):  # the graph only, abstractly (docs/spmd.md, NNX)
            graphdef, _ = nnx.split(nnx.eval_shape(lambda: tf.Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)

        def params(key):
            with nnx.use_eager_sharding(False):  # made on one device; laid out by parallelize
                return nnx.state(tf.Transformer(config, rngs=nnx.Rngs(key)), nnx.Param)

        def loss(params, batch):
            tokens = batch["inputs"]
            mask = jnp.ones_like(tokens, dtype=bool)
            logits, _ = nnx.merge(graphdef, params)(
                tokens, tf.build_positions_from_mask(mask), None, tf.make_causal_attn_mask(mask))
            return cross_entropy(logits[:, :-1], tokens[:, 1:])
        return initializer(params), loss

    # the example's own FSDP x tensor-parallel config, on a mesh made as its train.py makes it
    init, loss = program(config(cfg.ShardingConfig.fsdp_tp_sharding(
        fsdp_axis_name="fsdp", tensor_parallel_axis_name="tp")))
    reference_init, reference_loss = program(config(cfg.ShardingConfig.no_sharding()))
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    return Model(
        "flax_gemma", init=init, loss=loss,
        spmd={"mesh": mesh, "rules": (("batch", "fsdp"),)},
        # the NNX submodules by attribute path; the tied embedder's lookup (its __call__, "embedder") on
        # the first stage, its logits (its method attend, "embedder.attend") with the last
        stages=(r"embedder|layers\.0", r"layers\.1|final_norm|embedder\.attend"),
        stage_mesh={"fsdp": 2, "tp": 2}, stage_rules=(("batch", "fsdp"),),
        stage_params=(("embedder", "layers/0"), ("layers/1", "final_norm")),
        reference_init=reference_init, reference_loss=reference_loss,
        context=lambda: jax.set_mesh(mesh))


#: T5X's standard_logical_axis_rules() (t5x/partitioning.py, 1-D activations and parameters), as it returns them
T5X_RULES = (("batch", "data"), ("vocab", "model"), ("embed", None), ("mlp", "model"), ("heads", "model"),
             ("kv", None), ("joined_kv", "model"), ("relpos_buckets", None), ("abspos_buckets", None),
             ("length", None), ("layers", None), ("stack", None), ("mlp_activations", None))


def t5x_t5() -> Model:
    network = _t5x()
    config = network.T5Config(vocab_size=VOCAB, emb_dim=16, num_heads=2, num_encoder_layers=2,
                              num_decoder_layers=2, head_dim=8, mlp_dim=32, mlp_activations=("gelu", "linear"),
                              dropout_rate=0.0)
    model = network.Transformer(config)

    def decoder_inputs(targets):  # teacher forcing: the targets shifted right, 0 first
        return jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))

    def loss(variables, batch):
        logits = model.apply(variables, batch["inputs"], decoder_inputs(batch["targets"]), batch["targets"],
                             enable_dropout=False)
        return cross_entropy(logits, batch["targets"])

    def make_params(key):  # model.init gives T5X's two collections: "params" and their names, "params_axes"
        tokens = jnp.ones((1, LENGTH), jnp.int32)
        return model.init(key, tokens, tokens, tokens, enable_dropout=False)

    return Model(
        "t5x_t5",
        init=initializer(make_params),
        loss=loss,
        spmd={"mesh": {"data": 4, "model": 2}, "rules": T5X_RULES},
        # the encoder on stage 0 with the shared embedding (which looks up the decoder's tokens too), the
        # decoder and its logits on stage 1
        stages=(r"token_embedder|encoder", r"decoder"),
        stage_mesh={"data": 2, "model": 2}, stage_rules=T5X_RULES,
        stage_params=(("token_embedder", "encoder"), ("decoder",)),
        own_jit_rules=T5X_RULES)


def flax_on_pjit() -> Model:
    """Flax's guide "Scale up Flax Modules on multiple devices": its LogicalMLP, a stack of blocks
    under nn.scan (parameters with a leading "layer" axis), logical names in
    nn.with_logical_partitioning and nn.with_logical_constraint, and a jax.lax.with_sharding_constraint
    to the guide's own 2 x 4 mesh. Its cells run as they are, in a namespace of their own: the
    imports, the mesh and `mesh_sharding`, and the model; the one-device reference runs them with
    `mesh` set to one device (the guide's constraint then names that device)."""
    page = THIRDPARTY / "flax_on_pjit" / "flax_on_pjit.md"
    cells = guide_cells(page, "import functools", "from jax.sharding import Mesh", "def mesh_sharding",
                        "class LogicalDotReluDot")
    assert len(cells) == 4, "the guide's cells changed"

    def guide(one_device: bool) -> dict:
        # a module of its own (Linen modules are dataclasses: their module must be importable)
        module = types.ModuleType(f"thirdparty_flax_on_pjit_{'one_device' if one_device else 'mesh'}")
        sys.modules[module.__name__] = module
        with contextlib.redirect_stdout(None):       # the cells print the mesh
            for cell in cells:
                import_or_skip("tests/thirdparty/flax_on_pjit/flax_on_pjit.md",
                               lambda: exec(compile(cell, str(page), "exec"), module.__dict__),  # noqa: B023
                               errors=(ImportError,))
        if one_device:
            module.mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
        return module.__dict__

    depth, width = 32, 16

    def program(namespace):
        model = namespace["LogicalMLP"](2, depth, True)   # num_layers, depth, use_scan

        def loss(params, batch):
            out = model.apply(params, batch["x"])
            return jnp.sum((out - batch["y"]) ** 2) / (BATCH * width)
        return model, loss

    namespace = guide(one_device=False)
    model, loss = program(namespace)
    _, reference_loss = program(guide(one_device=True))

    def batch():
        x = jax.random.normal(jax.random.key(1), (BATCH, width))
        return {"x": x, "y": jnp.sin(x)}

    return Model(
        "flax_on_pjit",
        init=initializer(lambda key: model.init(key, jnp.ones((1, width)))),
        loss=loss, reference_loss=reference_loss, batch=batch,
        # the guide's mesh and rules; "layer" (the scan axis) and "embed" have no rule: replicated
        spmd={"mesh": namespace["mesh"], "rules": (("batch", "data"), ("hidden", "model"))})


MODELS: dict[str, Callable[[], Model]] = {"flax_lm1b": lm1b, "flax_wmt": wmt, "nanodo": nanodo, "flax_gemma": gemma,
                                          "flax_on_pjit": flax_on_pjit, "t5x_t5": t5x_t5}


@functools.cache
def model(name: str) -> Model:
    return MODELS[name]()


# ----------------------------------------------------------------- the three programs, built once
@functools.cache
def reference_step(name: str) -> Callable:
    """The step on one device: no mesh, no tasks, no microbatches."""
    m = model(name)
    return jax.jit(make_step(m.reference_loss or m.loss))


@functools.cache
def reference(name: str) -> tuple[list[float], list[Any]]:
    """The one-device run: STEPS losses and the host state after each step."""
    m = model(name)
    step = reference_step(name)
    state, batch = jax.jit(m.reference_init or m.init)(), m.batch()
    losses, states = [], []
    for _ in range(STEPS):
        loss, state = step(state, batch)
        losses.append(float(loss))
        states.append(jax.device_get(state))
    return losses, states


@functools.cache
def spmd(name: str):
    m = model(name)
    with m.context():
        return parallelize(make_step(m.loss), init_params=m.init, get_input_batch=m.batch, **m.spmd)


def stage_meshes(m: Model) -> list:
    devices = jax.devices()
    return [build_mesh(m.stage_mesh, devices[:4]), build_mesh(m.stage_mesh, devices[4:])]


@functools.cache
def pipeline(name: str):
    m = model(name)
    with m.context(), contextlib.ExitStack() as registrations:
        for pattern, mesh in zip(m.stages, stage_meshes(m)):
            registrations.enter_context(register_task(pattern, mesh=mesh, logical_axes=m.stage_rules))
        return parallelize(make_step(m.loss, MICROBATCHES), init_params=m.init, get_input_batch=m.batch,
                           param_rules=m.param_rules)


def run(name: str, built, steps: int, state=None) -> tuple[list[float], Any]:
    step_fn, init_fn, batch_fn = built
    with model(name).context():
        state = init_fn() if state is None else state
        batch, losses = batch_fn(), []
        for _ in range(steps):
            loss, state = step_fn(state, batch)
            losses.append(float(loss))
    return losses, state


@functools.cache
def parameter_tolerance(name: str) -> float:
    """The absolute tolerance of the parameters: 1e-5, or for a model run as its own code runs it
    (`Model.own_jit_rules`), the larger of 1e-4 and twice its own jit's largest difference from one device
    over the reference's steps (Adam turns the order of a sharded sum into such differences)."""
    m = model(name)
    if m.own_jit_rules is None:
        return 1e-5
    from flax.linen import partitioning as nn_partitioning

    _, ref_states = reference(name)
    step, state, batch = jax.jit(make_step(m.loss)), m.init(), m.batch()
    largest = 0.0
    with jax.set_mesh(build_mesh(m.spmd["mesh"])), nn_partitioning.axis_rules(m.own_jit_rules):
        for ref in ref_states:
            _, state = step(state, batch)
            largest = max(largest, *(float(np.max(np.abs(np.asarray(a) - b)))
                                     for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(ref))))
    return max(1e-4, 2 * largest)


def assert_matches_reference(name: str, losses: list[float], state: Any, first: int = 0) -> None:
    """Losses of steps ``first..`` and the state after them equal the one-device run's."""
    ref_losses, ref_states = reference(name)
    np.testing.assert_allclose(losses, ref_losses[first:first + len(losses)], rtol=1e-5)
    got, want = jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(ref_states[first + len(losses) - 1])
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=parameter_tolerance(name))


def subtree(tree: Any, path: str) -> Any:
    """The subtree at a ``/``-path of a state: dict keys, or list indices (an NNX ``nnx.List``)."""
    for key in path.split("/"):
        try:
            tree = tree[key]
        except (KeyError, TypeError):
            tree = tree[int(key)]
    return tree


def leaf(tree: Any, path: str) -> jax.Array:
    """The array at a ``/``-path (unwrapped from its Linen box or NNX variable)."""
    (array,) = jax.tree.leaves(subtree(tree, path))
    return array


# ----------------------------------------------------------------- SPMD
#: per model, a parameter and the shard shape its rules give it on the 8-device mesh
SPMD_SHARDS = {
    # ("embed", "mlp") -> mlp over model=2
    "flax_lm1b": ("params/decoder/encoderdecoderblock_0/MlpBlock_0/Dense_0/kernel", P(None, "model"), (16, 16)),
    # no metadata: the path rule (None, "mlp") -> mlp over model=2
    "flax_wmt": ("params/encoder/encoderblock_0/MlpBlock_0/Dense_0/kernel", P(None, "model"), (16, 16)),
    # nn.with_partitioning(..., (None, "data")): D=16 over data=8
    "nanodo": ("params/embed/embedding", P(None, "data"), (VOCAB, 2)),
    # out_sharding P("fsdp", "tp") of the gate projection: (16, 32) over fsdp=4 x tp=2
    "flax_gemma": ("layers/0/mlp/gate_proj/kernel", P("fsdp", "tp"), (4, 16)),
    # nn.scan stacks the blocks: (layer, embed, hidden) = (2, 16, 32), hidden over model=4
    "flax_on_pjit": ("params/ScanLogicalDotReluDot_0/Dense_0/kernel", P(None, None, "model"), (2, 16, 8)),
    # params_axes ("embed", "mlp") of the first MLP input: (16, 32), mlp over model=2
    "t5x_t5": ("params/encoder/layers_0/mlp/wi_0/kernel", P(None, "model"), (16, 16)),
}


# t5x_t5 (11 s) with -m slow: its pipeline meets one device in the default suite
@pytest.mark.parametrize("name", ["flax_lm1b", "flax_wmt", "nanodo", "flax_gemma", "flax_on_pjit",
                                  pytest.param("t5x_t5", marks=pytest.mark.slow)])
def test_spmd_equals_one_device(name):
    losses, state = run(name, spmd(name), SAVE_AT)
    assert_matches_reference(name, losses, state)
    path, spec, shard = SPMD_SHARDS[name]
    for tree in (state["params"], state["opt"][0].mu):   # the optimizer state keeps the parameters' layout
        array = leaf(tree, path)
        assert array.sharding.spec == spec, (path, array.sharding.spec)
        assert {s.data.shape for s in array.addressable_shards} == {shard}
        assert len(array.sharding.device_set) == 8


# ----------------------------------------------------------------- the users' own state objects
def test_flax_on_pjit_guide_train_state():
    """The guide's own `init_fn`: a flax TrainState built inside the initializer (with its optax
    optimizer and apply_fn as static fields), trained by `state.apply_gradients`, as in the guide."""
    m = model("flax_on_pjit")
    guide = sys.modules["thirdparty_flax_on_pjit_mesh"].__dict__
    page = THIRDPARTY / "flax_on_pjit" / "flax_on_pjit.md"
    exec(compile(guide_cells(page, "def init_fn(")[0], str(page), "exec"), guide)
    init_fn, net = guide["init_fn"], guide["LogicalMLP"](2, 32, True)
    params = jax.tree.map(jnp.asarray, jax.device_get(m.init()["params"]["params"]))   # the reference's values

    def init():
        state = init_fn(jax.random.key(0), jnp.ones((1, 16)), net, TX)
        return state.replace(params=params, opt_state=TX.init(params))

    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: m.loss({"params": p}, batch))(state.params)
        return loss, state.apply_gradients(grads=grads)

    built = parallelize(step, init_params=init, get_input_batch=m.batch, **m.spmd)
    losses, state = run("flax_on_pjit", built, SAVE_AT)
    ref_losses, ref_states = reference("flax_on_pjit")
    np.testing.assert_allclose(losses, ref_losses[:SAVE_AT], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_states[SAVE_AT - 1]["params"]["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert int(state.step) == SAVE_AT
    kernel = leaf(state.params, "ScanLogicalDotReluDot_0/Dense_0/kernel")
    assert kernel.sharding.spec == P(None, None, "model")


def test_gemma_nnx_optimizer():
    """Gemma trained as its example's train.py does: an nnx.Optimizer built with the model inside
    the initializer, the step merging both and calling optimizer.update(model, grads)."""
    from flax import nnx
    g = _gemma()
    cfg, tf = g["transformer_cfg"], g["transformer"]
    m = model("flax_gemma")
    config = cfg.TransformerConfig(
        num_layers=2, num_embed=VOCAB, embed_dim=16, hidden_dim=32, num_heads=2, head_dim=8, num_kv_heads=1,
        final_logit_softcap=None, use_post_attn_norm=True, use_post_ffw_norm=True,
        attention_types=(cfg.AttentionType.GLOBAL,) * 2,
        shd_config=cfg.ShardingConfig.fsdp_tp_sharding(fsdp_axis_name="fsdp", tensor_parallel_axis_name="tp"))
    params = jax.device_get(m.init()["params"])   # the reference's values

    def build():
        net = tf.Transformer(config, rngs=nnx.Rngs(0))
        nnx.update(net, jax.tree.map(jnp.asarray, params))
        return net, nnx.Optimizer(net, TX, wrt=nnx.Param)

    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(build))

    def step(state, batch):
        net, optimizer = nnx.merge(graphdef, state)
        tokens, mask = batch["inputs"], jnp.ones_like(batch["inputs"], dtype=bool)

        def loss_fn(net):
            logits, _ = net(tokens, tf.build_positions_from_mask(mask), None, tf.make_causal_attn_mask(mask))
            return cross_entropy(logits[:, :-1], tokens[:, 1:])
        loss, grads = nnx.value_and_grad(loss_fn)(net)
        optimizer.update(net, grads)
        return loss, nnx.state((net, optimizer))

    with m.context():
        built = parallelize(step, init_params=lambda: nnx.state(build()), get_input_batch=m.batch, **m.spmd)
    losses, state = run("flax_gemma", built, SAVE_AT)  # in the model's context, as built
    ref_losses, ref_states = reference("flax_gemma")
    np.testing.assert_allclose(losses, ref_losses[:SAVE_AT], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state[0]), jax.tree.leaves(ref_states[SAVE_AT - 1]["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    kernel = leaf(state[0], "layers/0/mlp/gate_proj/kernel")
    assert kernel.sharding.spec == P("fsdp", "tp")


def test_gemma_explicit_mesh_without_set_mesh():
    """`parallelize(mesh=explicit_mesh)` alone, without the user's own jax.set_mesh around it: the
    step is traced under the Explicit mesh, so Gemma's out_sharding= PartitionSpecs resolve."""
    m = model("flax_gemma")
    step_fn, init_fn, batch_fn = parallelize(make_step(m.loss), init_params=m.init, get_input_batch=m.batch,
                                             **m.spmd)
    state, batch, losses = init_fn(), batch_fn(), []
    for _ in range(SAVE_AT):
        loss, state = step_fn(state, batch)
        losses.append(float(loss))
    assert_matches_reference("flax_gemma", losses, state)


def activation_constraints(step_fn, state, batch, shape: tuple[int, ...]) -> int:
    """How many sharding constraints the lowered step puts on values of ``shape`` (float32)."""
    tensor = "tensor<" + "x".join(map(str, shape)) + "xf32>"
    return sum(1 for line in step_fn.lower(state, batch).as_text().splitlines()
               if tensor in line and ("sharding_constraint" in line or "@Sharding" in line))


def test_flax_logical_constraint_resolved_by_rules():
    """The guide's block constrains its output z to ("batch", "embed"): under `parallelize`'s rules
    that is ("data", None), the constraint a Flax user gets inside jax.set_mesh(mesh) and
    nn.logical_axis_rules(rules) (forward and backward). (Flax alone makes it a no-op without its
    own rules and a mesh in context.)"""
    import flax.linen as nn
    m = model("flax_on_pjit")
    step_fn, init_fn, batch_fn = spmd("flax_on_pjit")
    state, batch = init_fn(), batch_fn()
    z = (BATCH, 16)
    with jax.set_mesh(m.spmd["mesh"]), nn.logical_axis_rules(m.spmd["rules"]):
        flax_step = parallelize(make_step(m.loss), init_params=m.init, get_input_batch=m.batch, **m.spmd)[0]
        expected = activation_constraints(flax_step, state, batch, z)
    assert expected == 2
    assert activation_constraints(step_fn, state, batch, z) == expected


# ----------------------------------------------------------------- pipeline
def _pipeline_case(name: str, reason: str | None = None):
    marks = [pytest.mark.xfail(strict=True, reason=reason),   # the unmatched patterns warn, as they should
             pytest.mark.filterwarnings("ignore:parallelize. register_task patterns")] if reason else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [
    _pipeline_case("flax_lm1b"),
    _pipeline_case("flax_wmt"),
    _pipeline_case("nanodo"),
    _pipeline_case("flax_gemma"),
    _pipeline_case("t5x_t5"),
])
def test_pipeline_equals_one_device(name):
    m = model(name)
    step_fn = pipeline(name)[0]
    schedule = getattr(getattr(step_fn, "plan", None), "schedule", None)
    assert schedule is not None, f"the patterns {m.stages} formed no pipeline"
    assert schedule.num_stages == 2
    losses, state = run(name, pipeline(name), SAVE_AT)
    assert_matches_reference(name, losses, state)
    # each registered layer's parameters (and their adam moments) live on its stage's 4 devices only
    devices = jax.devices()
    on_stage = [set(devices[:4]), set(devices[4:])]
    trees = (state["params"], state["opt"][0].mu, state["opt"][0].nu)
    for stage, subtrees in enumerate(m.stage_params):
        for path in subtrees:
            for tree in trees:
                top = tree["params"] if isinstance(tree, dict) and "params" in tree else tree
                for array in jax.tree.leaves(subtree(top, path)):
                    assert array.sharding.device_set == on_stage[stage], (path, stage)
    # and every other parameter (an unregistered tied embedding, say) is held by one stage
    for array in jax.tree.leaves(trees):
        assert array.sharding.device_set in on_stage
    if name in PIPELINE_SHARDS:  # laid out by the model's own names and rules on its stage's submesh
        path, spec, shard = PIPELINE_SHARDS[name]
        for tree in (state["params"], state["opt"][0].mu):
            array = leaf(tree, path)
            assert array.sharding.spec == spec and {s.data.shape for s in array.addressable_shards} == {shard}


#: per model, a parameter and the spec and shard shape its own names give it on its stage
PIPELINE_SHARDS = {
    # params_axes ("embed", "mlp") on stage 1's {data: 2, model: 2}: mlp over model=2
    "t5x_t5": ("params/decoder/layers_1/mlp/wi_0/kernel", P(None, "model"), (16, 16)),
}


def test_gemma_tied_embedder_is_read_on_both_stages():
    """Gemma's natural layout: the embedder's lookup (``embedder``) with the first layers, its logits
    (``embedder.attend``, an NNX method other than ``__call__``) with the last; the table lives on the
    first stage and is copied to the last, forward and backward alike."""
    fn = pipeline("flax_gemma")[0]
    seen = set()
    for seg in fn.plan.segments:
        for e in seg.eqns:
            names = scope_names(e.source_info.name_stack)
            if "embedder.attend" in names or "embedder" in names:
                use = "logits" if "embedder.attend" in names else "lookup"
                # the stages by what their patterns match: r"embedder|layers\.0", r"layers\.1|final_norm|embedder\.attend"
                want = "layers.1+final_norm+embedder.attend" if use == "logits" else "embedder+layers.0"
                assert seg.placement.name == want, (use, seg.placement.name)
                seen.add((use, is_backprop(e.source_info.name_stack)))
    assert seen == {(u, b) for u in ("lookup", "logits") for b in (False, True)}
    # the (VOCAB, embed_dim) table: copied to the logits' stage once a step, its gradient back per microbatch
    copies = re.findall(r"reshard float32\[32[@\w]*,16[@\w]*\] from (input|\[\d+\])", str(fn.plan))
    assert copies.count("input") == 1 and len(copies) == 1 + MICROBATCHES, copies


def test_gemma_pipeline_estimate_holds_what_it_built():
    """The Gemma pipeline on Explicit axes: Flax NNX's Embed with out_sharding takes its rows under
    jax.sharding.auto_axes, so a value crosses from stage to stage typed on Auto axes of the Explicit mesh.
    The estimate compiles every program from abstract inputs typed as the run's arrays are, and its bytes
    per device equal the shards the built step holds."""
    fn, init_fn, batch_fn = pipeline("flax_gemma")
    with model("flax_gemma").context():
        state, batch = init_fn(), batch_fn()
    est = fn.estimate(profile="h100-sxm")
    assert len(est.programs) == len(fn.runtime.programs)
    for kind, tree in (("params", state["params"]), ("optimizer", state["opt"]), ("batch", batch)):
        held: dict[int, int] = {}
        for array in jax.tree.leaves(tree):
            for shard in array.addressable_shards:
                held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
        assert {d: getattr(m, kind) for d, m in est.memory.items() if getattr(m, kind)} == held, kind


def test_pipeline_flax_on_pjit_guide():
    """The guide's LogicalMLP with its for-loop of blocks (use_scan=False), one block per stage."""
    m = model("flax_on_pjit")
    guide = sys.modules["thirdparty_flax_on_pjit_mesh"].__dict__
    net = guide["LogicalMLP"](2, 32, False)
    init = initializer(lambda key: net.init(key, jnp.ones((BATCH, 16))))

    def loss(params, batch):
        return jnp.sum((net.apply(params, batch["x"]) - batch["y"]) ** 2) / (BATCH * 16)

    rules = m.spmd["rules"]
    devices = jax.devices()
    with register_task(r"LogicalDotReluDot_0", mesh=build_mesh({"data": 2, "model": 2}, devices[:4]),
                       logical_axes=rules), \
            register_task(r"LogicalDotReluDot_1", mesh=build_mesh({"data": 2, "model": 2}, devices[4:]),
                          logical_axes=rules):
        step_fn, init_fn, batch_fn = parallelize(make_step(loss, MICROBATCHES), init_params=init,
                                                 get_input_batch=m.batch)
    assert step_fn.plan.schedule.num_stages == 2
    state, batch = init_fn(), batch_fn()
    for _ in range(SAVE_AT):
        loss_value, state = step_fn(state, batch)
    # the reference: the guide's one-device namespace, the same parameters
    one_device = sys.modules["thirdparty_flax_on_pjit_one_device"].__dict__["LogicalMLP"](2, 32, False)
    ref_step = jax.jit(make_step(lambda p, b: jnp.sum((one_device.apply(p, b["x"]) - b["y"]) ** 2) / (BATCH * 16)))
    ref_state, ref_batch = init(), jax.device_get(batch)  # the pipeline's batch lives on its stages
    for _ in range(SAVE_AT):
        ref_loss, ref_state = ref_step(ref_state, ref_batch)
    np.testing.assert_allclose(float(loss_value), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(ref_state))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for stage, block in enumerate(("LogicalDotReluDot_0", "LogicalDotReluDot_1")):
        for array in jax.tree.leaves(state["params"]["params"][block]):
            assert array.sharding.device_set == set(devices[4 * stage:4 * stage + 4])


# ----------------------------------------------------------------- checkpoints
def one_device_target(name: str) -> Any:
    m = model(name)
    return abstract_target(jax.eval_shape(m.reference_init or m.init), SingleDeviceSharding(jax.devices()[0]))


@pytest.mark.parametrize("name, source, target", [
    ("flax_lm1b", "pipeline", "spmd"),
    ("flax_wmt", "pipeline", "spmd"),
    ("nanodo", "spmd", "one device"),
    ("flax_gemma", "spmd", "one device"),
    ("flax_gemma", "spmd", "pipeline"),   # onto its natural layout: the tied table on the first stage
    ("flax_on_pjit", "spmd", "one device"),
    ("t5x_t5", "spmd", "pipeline"),
])
def test_checkpoint_across_layouts(name, source, target, tmp_path):
    """Save after SAVE_AT steps on ``source``, restore onto ``target`` bit for bit, and train on:
    the restored run ends where the one-device run does."""
    built = pipeline(name) if source == "pipeline" else spmd(name)
    _, state = run(name, built, SAVE_AT)
    saved = jax.device_get(state)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(SAVE_AT, state, metadata={"model": name, "layout": source})
    if target in ("spmd", "pipeline"):
        step_fn = (spmd if target == "spmd" else pipeline)(name)[0]
        with CheckpointManager(tmp_path / "ckpt", read_only=True) as mgr:
            restored = mgr.restore(SAVE_AT, target=step_fn)
        expected = jax.tree.leaves(step_fn.param_shardings)
    elif target == "pipeline":
        step_fn = pipeline(name)[0]
        with CheckpointManager(tmp_path / "ckpt", read_only=True) as mgr:
            restored = mgr.restore(SAVE_AT, target=step_fn)
        expected = [leaf.sharding for leaf in step_fn.param_layout.leaves]
    else:
        step_fn = reference_step(name)
        with CheckpointManager(tmp_path / "ckpt", read_only=True) as mgr:
            restored = mgr.restore(SAVE_AT, target=one_device_target(name))
        expected = [SingleDeviceSharding(jax.devices()[0])] * len(jax.tree.leaves(saved))
    assert restored.step == SAVE_AT and restored.metadata == {"model": name, "layout": source}
    got = jax.tree.leaves(restored.state)
    assert len(got) == len(jax.tree.leaves(saved)) == len(expected)
    for a, b, sharding in zip(got, jax.tree.leaves(saved), expected):
        assert np.array_equal(np.asarray(a), b)                     # bit for bit
        assert a.sharding.is_equivalent_to(sharding, a.ndim)
    state, losses = restored.state, []
    with model(name).context() if target != "one device" else contextlib.nullcontext():
        for _ in range(STEPS - SAVE_AT):
            loss, state = step_fn(state, model(name).batch())
            losses.append(float(loss))
    assert_matches_reference(name, losses, state, first=SAVE_AT)


# ----------------------------------------------------------------- the vendored files and the reference
def git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_vendored_files_are_unmodified():
    """Every vendored file is listed in MANIFEST.tsv with its upstream git blob id, and matches it."""
    rows = [line.split("\t") for line in (THIRDPARTY / "MANIFEST.tsv").read_text().splitlines()
            if line and not line.startswith("#")]
    listed = {row[0]: row[4] for row in rows}
    vendored = {str(p.relative_to(THIRDPARTY)) for p in THIRDPARTY.rglob("*")
                if p.is_file() and p.name not in ("README.md", "MANIFEST.tsv") and "__pycache__" not in p.parts}
    assert vendored == set(listed)
    for path, blob in listed.items():
        assert git_blob_id(THIRDPARTY / path) == blob, f"{path} differs from its upstream blob {blob}"

def test_reference_trains():
    """The reference runs are real training: the loss goes down for every model."""
    for name in MODELS:
        losses, _ = reference(name)
        assert losses[-1] < losses[0] - 0.1, (name, losses)
