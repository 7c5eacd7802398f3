"""Small models, train steps and a one-device reference runner for the SPMD tests.

Everything parallel is compared with the same program run by plain `jax.jit`
on one device (`run_reference`). The models carry logical axis names through
Flax metadata (`nn.with_logical_partitioning`, `nnx.with_partitioning`), so
the rules alone decide how they are sharded.

Expected shardings are computed here from a plain ``{logical_name: mesh_axis}``
table (`expected_spec`), independently of the library's rule engine; the test
configurations are chosen so that no divisibility or stacking decision arises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from multimesh.jax import ignore_transforms, parallelize, register_task, with_sharding_constraint

RTOL = 1e-5
ATOL = 1e-6

# ----------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------


def logical(init: Callable, names: tuple) -> Callable:
    return nn.with_logical_partitioning(init, names)


class MLP(nn.Module):
    """Megatron-style MLP: embed -> mlp -> embed."""

    hidden: int = 64
    features: int = 16

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(
            self.hidden,
            kernel_init=logical(nn.initializers.lecun_normal(), ("embed", "mlp")),
            bias_init=logical(nn.initializers.normal(0.1), ("mlp",)),
        )(x)
        h = nn.relu(h)
        return nn.Dense(
            self.features,
            kernel_init=logical(nn.initializers.lecun_normal(), ("mlp", "embed")),
            bias_init=logical(nn.initializers.normal(0.1), ("embed",)),
        )(h)


class Attention(nn.Module):
    """A pre-norm self-attention block with a residual; x is (batch, seq, embed).

    The queries carry an activation constraint with logical names, resolved
    by the rules in scope (and a no-op on one device).
    """

    heads: int = 8
    head_dim: int = 4

    @nn.compact
    def __call__(self, x):
        embed = x.shape[-1]
        h = nn.LayerNorm(
            scale_init=logical(nn.initializers.ones, ("embed",)),
            bias_init=logical(nn.initializers.zeros, ("embed",)),
        )(x)

        def proj(name, use_bias=True):
            return nn.DenseGeneral(
                (self.heads, self.head_dim),
                kernel_init=logical(nn.initializers.lecun_normal(), ("embed", "heads", "kv")),
                bias_init=logical(nn.initializers.zeros, ("heads", "kv")),
                use_bias=use_bias,
                name=name,
            )(h)

        # no key bias: its gradient is exactly zero (softmax is shift invariant), and adam
        # would turn rounding noise in it into full-size updates
        q, k, v = proj("query"), proj("key", use_bias=False), proj("value")
        q = with_sharding_constraint(q, P("batch", None, "heads", None))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.head_dim)
        weights = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        out = nn.DenseGeneral(
            embed,
            axis=(-2, -1),
            kernel_init=logical(nn.initializers.lecun_normal(), ("heads", "kv", "embed")),
            bias_init=logical(nn.initializers.zeros, ("embed",)),
            name="out",
        )(out)
        return x + out


class ResidualBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(x)


class StemNet(nn.Module):
    """A Dense ``stem`` and four residual blocks ``block_0`` to ``block_3``: module names for stage patterns."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="stem")(x)
        for i in range(4):
            x = ResidualBlock(name=f"block_{i}")(x)
        return x


def mlp_batch(n: int = 32, features: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)
    return {
        "x": rs.randn(n, features).astype(np.float32),
        "y": rs.randn(n, features).astype(np.float32),
    }


def attention_batch(n: int = 16, seq: int = 8, embed: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)
    return {
        "x": rs.randn(n, seq, embed).astype(np.float32),
        "y": rs.randn(n, seq, embed).astype(np.float32),
    }


# Loss-returning models for `parallelize_step` (``model.apply(params, batch) -> loss``).


class LinenLossModel(nn.Module):
    @nn.compact
    def __call__(self, batch):
        h = nn.Dense(
            32,
            kernel_init=logical(nn.initializers.lecun_normal(), ("embed", "mlp")),
            bias_init=logical(nn.initializers.normal(0.1), ("mlp",)),
        )(batch["x"])
        y = nn.Dense(4, kernel_init=logical(nn.initializers.lecun_normal(), ("mlp", "embed")))(nn.relu(h))
        return jnp.mean((y - batch["y"]) ** 2)


class NNXLossModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(
            8,
            32,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
            bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), ("mlp",)),
            rngs=rngs,
        )
        self.b = nnx.Linear(
            32,
            4,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("mlp", "embed")),
            rngs=rngs,
        )

    def __call__(self, batch):
        return jnp.mean((self.b(nnx.relu(self.a(batch["x"]))) - batch["y"]) ** 2)


def loss_batch(n: int = 16, seed: int = 1) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)
    return {"x": rs.randn(n, 8).astype(np.float32), "y": rs.randn(n, 4).astype(np.float32)}


# ----------------------------------------------------------------------------
# Train steps
# ----------------------------------------------------------------------------


def make_init(model: nn.Module, tx: optax.GradientTransformation, example_x: Any, seed: int = 0) -> Callable[[], dict]:
    """A zero-argument ``init_params``: ``{"params": variables, "opt": tx.init(variables)}`` (Linen boxes kept)."""

    def init():
        variables = model.init(jax.random.key(seed), jnp.asarray(example_x))
        return {"params": variables, "opt": tx.init(variables)}

    return init


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, *, with_grads: bool = False) -> Callable:
    """``step(state, batch) -> (loss, new_state)`` (``(loss, new_state, grads)`` with ``with_grads``)."""

    def loss_fn(variables, batch):
        return jnp.mean((model.apply(variables, batch["x"]) - batch["y"]) ** 2)

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt}
        return (loss, new, grads) if with_grads else (loss, new)

    step.__name__ = "train_step_with_grads" if with_grads else "train_step"
    return step


def nnx_reference_parts(factory: Callable, seed: int = 42) -> tuple[Any, Callable]:
    """One-device NNX reference: (params, loss(params, batch)) of ``factory(nnx.Rngs(seed))``."""
    with nnx.use_eager_sharding(False):
        model = factory(nnx.Rngs(seed))
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)

    def loss(p, batch):
        return nnx.merge(graphdef, p, *rest)(batch)

    return params, loss


def optax_loop(loss: Callable, params: Any, tx: optax.GradientTransformation, batch: Any, steps: int) -> tuple[list, Any]:
    """Plain optax on one device: losses (before each update) and the final params."""
    device = jax.devices()[0]

    @jax.jit
    def step(p, opt, b):
        value, grads = jax.value_and_grad(loss)(p, b)
        updates, opt = tx.update(grads, opt, p)
        return value, optax.apply_updates(p, updates), opt

    params = jax.device_put(params, device)
    batch = jax.device_put(batch, device)
    opt = jax.jit(tx.init)(params)
    losses = []
    for _ in range(steps):
        value, params, opt = step(params, opt, batch)
        losses.append(float(value))
    return losses, params


# ----------------------------------------------------------------------------
# One-device reference runner
# ----------------------------------------------------------------------------


def on_one_device(tree: Any, device=None) -> bool:
    device = device or jax.devices()[0]
    return all(leaf.sharding.device_set == {device} for leaf in jax.tree.leaves(tree))


def run_reference(step: Callable, init: Callable[[], Any], batch: Any, steps: int) -> dict[str, Any]:
    """Run ``init`` then ``steps`` calls of ``step`` with plain `jax.jit` on device 0.

    Returns ``{"init": state0, "outputs": [step outputs...]}``.
    """
    device = jax.devices()[0]
    with jax.default_device(device):
        state = jax.jit(init)()
        b = jax.device_put(batch, device)
        jitted = jax.jit(step)
        outputs = []
        state0 = state
        for _ in range(steps):
            out = jitted(state, b)
            jax.block_until_ready(out)
            outputs.append(out)
            state = out[1]
    assert on_one_device(state0, device) and on_one_device(outputs, device)
    return {"init": state0, "outputs": outputs}


def check_mpmd_against_reference(step: Callable, init: Callable[[], Any], batch: Callable[[], Any], *,
                                 steps: int = 3, grad_rtol: float = RTOL, **options: Any) -> tuple[Any, Any]:
    """``parallelize(step)`` (tasks inside) against the same step jitted with tasks and microbatching off.

    ``step(state, batch) -> (loss, grads, new_state)``. Checks the loss and the
    gradients of every step and the final state; returns ``(step_fn, state)``.
    """
    fn, init_p, get_b = parallelize(step, init_params=init, get_input_batch=batch, **options)
    state, b = init_p(), get_b()

    def reference(*a):
        with ignore_transforms():
            return step(*a)

    ref = jax.jit(reference)
    ref_state, ref_b = init(), batch()
    for _ in range(steps):
        loss, grads, state = fn(state, b)
        ref_loss, ref_grads, ref_state = ref(ref_state, ref_b)
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
        assert_trees_close(grads, ref_grads, rtol=grad_rtol, what="gradients")
    assert_trees_close(state, ref_state, rtol=grad_rtol, what="state", as_float32=True)
    return fn, state


def two_matrices(tx: optax.GradientTransformation, d: int = 8) -> dict:
    """A state of two random ``d x d`` matrices ``a`` and ``b`` and ``tx``'s state for them."""
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {"a": jax.random.normal(k1, (d, d)), "b": jax.random.normal(k2, (d, d))}
    return {"params": p, "opt": tx.init(p)}


def xy_batch(b: int = 16, d: int = 8) -> dict:
    """Random inputs ``x`` and targets ``y``, both ``b x d``."""
    return {"x": jax.random.normal(jax.random.key(1), (b, d)), "y": jax.random.normal(jax.random.key(2), (b, d))}


def guide_cells(page: Path, *markers: str, fence: str = "```{code-cell}") -> list[str]:
    """The code cells of a notebook page in markdown that contain one of ``markers``, in order: MyST's
    (```{code-cell} ...), or Jupytext markdown's with ``fence="```python"``."""
    cells, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].startswith(fence):
            end = lines.index("```", i + 1)
            cells.append("\n".join(lines[i + 1:end]) + "\n")
            i = end
        i += 1
    return [c for c in cells if any(m in c for m in markers)]


def train_steps(step_fn: Callable, init_fn: Callable, batch_fn: Callable, steps: int) -> tuple[list[float], Any]:
    """``steps`` steps of a built step on one batch: the losses and the last state."""
    state, batch, losses = init_fn(), batch_fn(), []
    for _ in range(steps):
        loss, state = step_fn(state, batch)
        losses.append(float(loss))
    return losses, state


# ----------------------------------------------------------------------------
# Comparisons and expected shardings
# ----------------------------------------------------------------------------


def assert_trees_close(got: Any, want: Any, *, rtol: float = RTOL, atol: float = ATOL, what: str = "",
                       as_float32: bool = False) -> None:
    """The same leaves at the same paths (a box's metadata aside: NNX records how a variable was sharded
    there), every leaf close (compared in float32 with ``as_float32``: a bfloat16 leaf against its float32
    reference)."""
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
    got_paths = [jax.tree_util.keystr(p) for p, _ in got_leaves]
    want_paths = [jax.tree_util.keystr(p) for p, _ in want_leaves]
    assert got_paths == want_paths, (
        f"{what}: leaf paths differ: only in the result {sorted(set(got_paths) - set(want_paths))}, only in "
        f"the reference {sorted(set(want_paths) - set(got_paths))}"
        + ("" if set(got_paths) != set(want_paths) else " (the same paths in another order)")
    )
    dtype = np.float32 if as_float32 else None
    for (path, g), (_, w) in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(g, dtype), np.asarray(w, dtype), rtol=rtol, atol=atol,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_of(keypath: tuple) -> str:
    return "/".join(_key(k) for k in keypath)


def leaves_by_path(tree: Any) -> dict[str, Any]:
    return {path_of(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def boxed_leaves(tree: Any) -> list[tuple[str, jax.Array, tuple | None]]:
    """``(path, array, logical names or None)`` for every array of a tree with Linen boxes."""
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
    out = []
    for keypath, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
        if is_box(node):
            out.append((path_of(keypath), node.value, tuple(node.names)))
        else:
            out.append((path_of(keypath), node, None))
    return out


def norm_spec(spec: Any) -> tuple:
    """A PartitionSpec as a tuple without trailing Nones (JAX drops them on outputs)."""
    t = list(spec)
    while t and t[-1] is None:
        t.pop()
    return tuple(t)


def expected_spec(names: tuple | None, axes: Mapping[str, Any]) -> tuple:
    """The spec that the ``{logical: mesh_axis}`` table gives (no conflicts in the test configs)."""
    if names is None:
        return ()
    return norm_spec(tuple(axes.get(n) if n is not None else None for n in names))


def expected_shard_shape(shape: tuple, spec: tuple, mesh_shape: Mapping[str, int]) -> tuple:
    out = list(shape)
    for d, entry in enumerate(spec):
        if entry is None:
            continue
        for a in (entry,) if isinstance(entry, str) else entry:
            out[d] //= mesh_shape[a]
    return tuple(out)


def check_placement(
    arr: jax.Array, want: tuple, devices: set, mesh_shape: Mapping[str, int], what: str = ""
) -> None:
    """``arr``'s spec (up to trailing Nones), mesh, device set and shard shape."""
    sharding = arr.sharding
    assert isinstance(sharding, jax.sharding.NamedSharding), f"{what}: {sharding!r} is not a NamedSharding"
    assert norm_spec(sharding.spec) == want, f"{what}: spec {sharding.spec} != expected {want}"
    assert dict(sharding.mesh.shape) == dict(mesh_shape), f"{what}: mesh {dict(sharding.mesh.shape)} != {dict(mesh_shape)}"
    assert set(sharding.mesh.devices.flat) == devices, f"{what}: mesh devices {sharding.mesh.devices} != {devices}"
    assert arr.sharding.device_set == devices
    shard = arr.addressable_shards[0].data.shape
    assert shard == expected_shard_shape(arr.shape, want, mesh_shape), f"{what}: shard shape {shard} for spec {want}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port for a coordinator of processes a test starts, held by this process until it ends
    (`multimesh.distributed.reserve_port`: gRPC's coordinator can still bind it, while no automatic bind
    of another process, such as JAX's transfer sockets, can take it first)."""
    from multimesh.distributed import reserve_port

    return reserve_port(host)


def run_commands(argvs: list[list[str]], *, timeout: float, extra_env: Mapping[str, str] | None = None,
                 envs: list[Mapping[str, str]] | None = None) -> list[tuple[int, str, str]]:
    """Run one process per argv (``python ARGV``, from this checkout's root without the caller's XLA_FLAGS, with
    ``extra_env`` and the process's own ``envs[i]`` added), wait at most ``timeout`` s, end only those still
    running, by pid; each one's exit status, stdout and stderr."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])  # this checkout
    env.update(extra_env or {})
    procs = [subprocess.Popen([sys.executable, *argv], cwd=root, env={**env, **(envs[i] if envs else {})},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, argv in enumerate(argvs)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def run_workers(argvs: list[list[str]], *, timeout: float,
                extra_env: Mapping[str, str] | None = None) -> list[dict]:
    """`run_commands`, then fail naming every process that failed (the first to fail may not be process 0),
    with its output's end; else their last stdout lines read as JSON, in order."""
    import json

    done = run_commands(argvs, timeout=timeout, extra_env=extra_env)
    failed = [f"process {i} failed ({code}); last output: {out.strip().splitlines()[-1:]}\n{err[-3000:]}"
              for i, (code, out, err) in enumerate(done) if code != 0]
    assert not failed, "\n".join(failed)
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in done]


def in_a_small_tmpfs(mount: str, size: str, argv: list[str]) -> list[str] | None:
    """The command that runs ``argv`` in a user and mount namespace with a tmpfs of
    ``size`` (e.g. ``"4m"``) mounted at ``mount``: a real disk that fills up, without
    root. ``None`` where user namespaces are off (``unshare -Urm`` fails)."""
    import shutil
    import subprocess

    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-Urm", "true"], capture_output=True,
                                         check=False).returncode != 0:
        return None
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    return [unshare, "-Urm", "sh", "-c", script, "sh", size, mount, *argv]


@contextlib.contextmanager
def stages(first: str, second: str) -> Iterator[tuple[Any, Any]]:
    """Two `register_task` stages: modules matching ``first`` on devices 0-3, ``second`` on 4-7."""
    devs = jax.devices()
    with register_task(first, devices=devs[:4]) as a, register_task(second, devices=devs[4:]) as b:
        yield a, b


@contextlib.contextmanager
def first_save_failing_while_its_state_is_written(most_s: float = 30.0) -> Iterator[Any]:
    """A test double of the checkpoint writing layer: the first save's document write fails with ENOSPC in
    its background thread at once, while the save's arrays are still being written in theirs (held until the
    yielded ``written`` event is set, or ``most_s`` seconds after the failure; ``failed_at`` receives the
    time the failed part ended): a disk that fills while a large item is still written. Later saves write as
    usual."""
    import asyncio
    import errno
    import threading
    import time
    import types

    from multimesh._compat.orbax import LeanByteLimit
    from multimesh.checkpoint.handlers import DocHandler

    go, failed = threading.Event(), threading.Event()
    double = types.SimpleNamespace(written=go, failed_at=[])
    reserve, prepare = LeanByteLimit.wait_for_bytes, DocHandler.prepare

    async def slow_reserve(self: Any, requested_bytes: int) -> None:  # in the arrays' writer thread
        if not go.is_set():
            await asyncio.to_thread(go.wait, 2 * most_s)
        await reserve(self, requested_bytes)

    async def failing_prepare(self: Any, x: Any) -> Any:  # in the document's writer thread
        if not failed.is_set():
            failed.set()
            part = threading.current_thread()  # the part ends (its failure known) once it has recorded the error
            threading.Thread(target=lambda: (threading.Thread.join(part), double.failed_at.append(time.monotonic())),
                             daemon=True).start()
            threading.Timer(most_s, go.set).start()
            raise OSError(errno.ENOSPC, "No space left on device")
        return await prepare(self, x)

    LeanByteLimit.wait_for_bytes, DocHandler.prepare = slow_reserve, failing_prepare  # type: ignore[method-assign]
    try:
        yield double
    finally:
        go.set()
        LeanByteLimit.wait_for_bytes, DocHandler.prepare = reserve, prepare  # type: ignore[method-assign]
