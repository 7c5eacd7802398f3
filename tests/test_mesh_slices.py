"""MultiMesh's mesh slices.

``Task(mesh_slice={"stage": i})`` slices the global mesh in force: a
`MultiMesh`'s, else JAX's mesh in context (``jax.set_mesh``, a legacy
``with mesh:``). ``Task(loop_dependent_mesh_slice=lambda i: ...)`` runs each
microbatch's forward and backward on that microbatch's slice (an embedding
load-balanced over the pipeline's stages). Numbers are checked against the
same step on one device; placements on the plan and on the arrays each unit
returns.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import check_mpmd_against_reference
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from multimesh.jax import (
    MultiMesh,
    Task,
    TaskMesh,
    clear_tasks,
    microbatch,
    parallelize,
    register_task,
    slice_global_mesh,
    task,
    with_sharding_constraint,
)
from multimesh.jax import flax as mmflax
from multimesh.trace.implicit import implicit_placement, is_backprop, microbatch_of, scope_names
from multimesh.trace.task import task_call_p

pytestmark = [pytest.mark.devices(8), pytest.mark.filterwarnings("ignore:.with mesh.. context manager")]


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    clear_tasks()


def grid(*names: str, devices=None) -> Mesh:
    """A 2 x 4 (or 2 x 2 x 2) mesh with Auto axes over ``devices`` (default: all, in order)."""
    devs = np.asarray(jax.devices() if devices is None else devices, dtype=object)
    return Mesh(devs.reshape((2, 4) if len(names) == 2 else (2, 2, 2)), names)


def ids(devices) -> set[int]:
    return {d.id for d in devices}


# -- mesh_slice against the mesh in context --------------------------------------------


def jax_contexts(mesh: Mesh):
    """The ways to put ``mesh`` in context: jax.set_mesh (as given, and with Explicit axes), a `with mesh:`."""
    explicit = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(mesh.axis_names))
    return {"set_mesh": lambda: jax.set_mesh(mesh), "set_mesh explicit": lambda: jax.set_mesh(explicit),
            "with mesh": lambda: mesh}


@pytest.mark.parametrize("how", ["set_mesh", "set_mesh explicit", "with mesh"])
def test_mesh_slice_slices_jax_mesh_in_context(how):
    mesh = grid("stage", "data", devices=jax.devices()[::-1])  # not jax.devices() order: the context's mesh counts
    spec = Task(name="s1", mesh_slice={"stage": 1}, logical_axes=[("batch", "data")])
    f = task(lambda a: with_sharding_constraint(a * 3, P("batch")), task=spec)
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    with jax_contexts(mesh)[how]():
        placement = spec.placement()
        y = f(x)
        numbers = slice_global_mesh(stage=1)
    assert placement.name == "s1" and dict(placement.mesh.shape) == {"stage": 1, "data": 4}
    assert ids(placement.devices) == {3, 2, 1, 0}  # row 1 of the reversed devices
    np.testing.assert_allclose(y, x * 3)
    assert ids(y.sharding.device_set) == {0, 1, 2, 3} and y.addressable_shards[0].data.shape == (2, 2)
    assert numbers.devices == (4, 5, 6, 7)  # relative numbers: positions in the mesh in context


def test_a_multimesh_wins_over_jax_mesh_in_context():
    spec = Task(mesh_slice={"stage": 0})
    with jax.set_mesh(grid("stage", "data")), MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"),
                                                         devices=jax.devices()[::-1]):
        assert ids(spec.placement("t").devices) == {7, 6, 5, 4}
    with grid("stage", "data"):
        with MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"), devices=jax.devices()[::-1]):
            assert ids(spec.placement("t").devices) == {7, 6, 5, 4}
        assert ids(spec.placement("t").devices) == {0, 1, 2, 3}


def test_no_mesh_anywhere_is_a_clear_error():
    f = task(lambda a: a, task=Task(name="head", mesh_slice={"stage": 1}))
    fix = (r"call the task \(or trace the step its registration matches: parallelize, jax.jit\) inside `with "
           r"MultiMesh\(...\):`, `with jax.set_mesh\(mesh\):` or `with mesh:`")
    with pytest.raises(ValueError, match=r"Task\('head'\): mesh_slice= slices the global mesh, and none is in force; "
                                         + fix):
        f(np.ones(4, np.float32))
    init, batch, step = linen_problem()
    register_task(r"layers_(\d+)", task=Task(name="s0", mesh_slice={"stage": 0}))  # accepted: sliced when traced
    with pytest.raises(ValueError, match=r"Task\('s0'\): mesh_slice= slices the global mesh, and none is in force"):
        parallelize(step, init_params=init, get_input_batch=batch)
    with pytest.raises(ValueError, match=r"Task\('t'\): mesh_slice=\{'pipe': 0\}: the global mesh \{'stage': 2, "
                                         r"'data': 4\} has no axis 'pipe'"), grid("stage", "data"):
        Task(name="t", mesh_slice={"pipe": 0}).placement()


def test_a_registration_slices_the_mesh_in_force_when_matched():
    """Registered under one mesh, matched under another: the lookup is not cached across meshes."""
    with jax.set_mesh(grid("stage", "data")):
        register_task(r"layers_1", task=Task(name="s1", mesh_slice={"stage": 1}))
        assert ids(implicit_placement("layers_1").devices) == {4, 5, 6, 7}
    with jax.set_mesh(grid("stage", "data", devices=jax.devices()[::-1])):
        assert ids(implicit_placement("layers_1").devices) == {3, 2, 1, 0}


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")), (16, 32))
        v = self.param("v", nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed")), (32, 16))
        return x + jnp.tanh(with_sharding_constraint(x @ w, P("batch", "mlp"))) @ v


class Net(nn.Module):
    vocab: int = 24
    embed: type = nn.Embed

    @nn.compact
    def __call__(self, tokens):
        table_init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
        x = self.embed(self.vocab, 16, name="embed", embedding_init=table_init)(tokens)
        for i in range(4):
            x = Block(name=f"layers_{i}")(x)
        return x


RULES = [("batch", "data"), ("mlp", "model"), ("embed", None), ("vocab", None)]
B = 16  # rows per step


def linen_problem(n_microbatches: int = 1, schedule: str = "1f1b", embed: type = nn.Embed):
    model, tx = Net(embed=embed), optax.adam(1e-2)

    def init():
        params = model.init(jax.random.key(0), jnp.zeros((4,), jnp.int32))
        return {"p": params, "o": tx.init(params)}

    def batch():
        return {"tok": jax.random.randint(jax.random.key(1), (B,), 0, 24),
                "y": jax.random.normal(jax.random.key(2), (B, 16))}

    def loss(p, b):
        return jnp.sum((model.apply(p, b["tok"]) - b["y"]) ** 2) / (B * 16)  # the global mean: microbatches sum

    def step(state, b):
        f = loss if n_microbatches == 1 else microbatch(loss, 0, B // n_microbatches, argnum=1, schedule=schedule)
        value, grads = jax.value_and_grad(f)(state["p"], b)
        updates, opt = tx.update(grads, state["o"], state["p"])
        return value, grads, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    return init, batch, step


def stage_of(name, backprop):
    layer = int(name.group(1))
    return Task(name=f"stage{layer // 2}", mesh_slice={"stage": layer // 2}, logical_axes=RULES)


def test_registered_slices_of_a_with_mesh_block_train_as_on_one_device():
    """The reference's style without a MultiMesh: tasks registered and run in a legacy ``with mesh:`` block."""
    mesh = grid("stage", "data", "model")
    init, batch, step = linen_problem()
    with mesh:
        register_task(r"layers_(\d+)", callback=stage_of)
        fn, state = check_mpmd_against_reference(step, init, batch)
    assert [p.name for p in fn.plan.placements] == ["stage0", "stage1"]
    for s, p in enumerate(fn.plan.placements):
        assert p.devices == set(mesh.devices[s].flat) and dict(p.mesh.shape) == {"stage": 1, "data": 2, "model": 2}
    w3 = state["p"]["params"]["layers_3"]["w"].value
    assert w3.sharding.device_set == set(mesh.devices[1].flat) and w3.sharding.spec == P(None, "model")


@pytest.mark.parametrize("n_mb", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_slices_registered_before_the_with_mesh_block_resolve_when_traced_inside_it(n_mb):
    """MultiMesh's own test style: ``Task``s with a ``mesh_slice`` (and, pipelined, the embedding's
    ``loop_dependent_mesh_slice``) registered first, then the step traced inside ``with mesh:``, where the
    slices are taken from that mesh."""
    slice_of = lambda i: (i + 1) % 2  # noqa: E731
    register_task(r"layers_[01]", task=Task(name="stage0", mesh_slice={"stage": 0}, logical_axes=RULES))
    register_task(r"layers_[23]", task=Task(name="stage1", mesh_slice={"stage": 1}, logical_axes=RULES))
    if n_mb > 1:
        register_task(r"embed", task=Task(name="embed", loop_dependent_mesh_slice=lambda i: {"stage": slice_of(i)},
                                          logical_axes=RULES))
    mesh = grid("stage", "data", "model", devices=jax.devices()[::-1])
    init, batch, step = linen_problem(n_mb, "1f1b")
    with mesh:
        fn, state = check_mpmd_against_reference(step, init, batch, grad_rtol=2e-5)
    stages = [p for p in fn.plan.placements if p.name.startswith("stage")]
    for s, p in enumerate(stages):
        assert p.devices == set(mesh.devices[s].flat) and dict(p.mesh.shape) == {"stage": 1, "data": 2, "model": 2}
    w3 = state["p"]["params"]["layers_3"]["w"].value
    assert w3.sharding.device_set == set(mesh.devices[1].flat) and w3.sharding.spec == P(None, "model")
    if n_mb > 1:
        check_units_on_their_slices(fn, state, batch, mesh, "embed", n_mb, slice_of)


# -- loop_dependent_mesh_slice: a task whose submesh depends on the microbatch ------------------


def record_units(fn) -> dict[int, list]:
    """Wrap every program call of ``fn``'s runtime: per plan segment, the arrays it returned."""
    seen: dict[int, list] = {}
    for host_call in fn.runtime.calls:  # each action its own call (grouping off by default)
        (step,) = host_call.steps
        def call(*args, _run=host_call.fn, _index=step.segment.index):
            outs = _run(*args)
            seen.setdefault(_index, []).extend(outs)
            return outs
        host_call.fn = call
    return seen


def units_of(fn, name: str) -> dict[tuple[int, bool], list]:
    """The segments running task ``name``'s own equations (an explicit task's call, or equations in its
    registered scope), by (microbatch, backward)."""
    out: dict[tuple[int, bool], list] = {}
    for seg in fn.plan.segments:
        own = [e for e in seg.eqns if (e.primitive is task_call_p and e.params["placement"].name == name)
               or name in scope_names(e.source_info.name_stack)]
        for e in own:
            stack = e.source_info.name_stack
            backward = e.params["kind"] == "bwd" if e.primitive is task_call_p else is_backprop(stack)
            out.setdefault((microbatch_of(stack), backward), []).append(seg)
    return out


def check_units_on_their_slices(fn, state, batch, mesh: Mesh, name: str, n_mb: int, slice_of) -> None:
    """Each microbatch's forward and backward units of task ``name`` ran, and returned their arrays, on that
    microbatch's slice; the pipeline's stages still follow the schedule."""
    seen = record_units(fn)
    fn(state, batch())
    units = units_of(fn, name)
    assert sorted(units) == [(m, b) for m in range(n_mb) for b in (False, True)]
    for (m, _), segments in units.items():
        want = set(mesh.devices[slice_of(m)].flat)
        for seg in segments:
            assert seg.placement.devices == want, (seg.label, m)
            assert seen[seg.index] and all(out.sharding.device_set == want for out in seen[seg.index]), seg.label
    stage_actions = [lab.split(":", 1)[1] for lab in fn.stats.executed if lab.startswith("stage")
                     and any(f":{k}[" in lab for k in "FB")]
    assert stage_actions == [str(a) for a in fn.plan.schedule.order]
    assert fn.plan.schedule.num_stages == 2


D, H, V = 16, 32, 24
TX = optax.adam(1e-2)


def explicit_problem(schedule: str | None, n_mb: int, slice_of, rows: str = "batch"):
    """Explicit tasks: an embedding on the slice ``slice_of(i)`` for microbatch i, then two stages on fixed slices
    (``schedule=None``: no microbatches, the embedding on ``slice_of(0)``). Activations' rows are constrained
    to ``rows``, a logical name or (code that runs as it is under ``jax.set_mesh``) a mesh axis."""
    rules = [("batch", "data")]

    def layer(w, x):
        return x + jnp.tanh(with_sharding_constraint(x @ w["a"], P(rows, None))) @ w["b"]

    def embed(table, tokens):
        return with_sharding_constraint(table[tokens], P(rows, None))

    lookup = task(embed, task=Task(name="embed", loop_dependent_mesh_slice=lambda i: {"stage": slice_of(i)},
                                   logical_axes=rules))
    stages = [task(layer, task=Task(name=f"stage{i}", mesh_slice={"stage": i}, logical_axes=rules)) for i in range(2)]

    def init():
        k = jax.random.split(jax.random.key(0), 5)
        p = {"emb": jax.random.normal(k[0], (V, D)),
             **{f"s{i}": {"a": jax.random.normal(k[1 + 2 * i], (D, H)) * .2,
                          "b": jax.random.normal(k[2 + 2 * i], (H, D)) * .2} for i in range(2)}}
        return {"p": p, "o": TX.init(p)}

    def batch():
        return {"tok": jax.random.randint(jax.random.key(5), (B,), 0, V),
                "y": jax.random.normal(jax.random.key(6), (B, D))}

    def loss(p, b):
        h = lookup(p["emb"], b["tok"])
        for i, s in enumerate(stages):
            h = s(p[f"s{i}"], h)
        return jnp.sum((h - b["y"]) ** 2) / (B * D)

    def step(state, b):
        pipelined = loss if schedule is None else microbatch(loss, 0, B // n_mb, argnum=1, schedule=schedule)
        value, grads = jax.value_and_grad(pipelined)(state["p"], b)
        updates, opt = TX.update(grads, state["o"], state["p"])
        return value, grads, {"p": optax.apply_updates(state["p"], updates), "o": opt}

    return init, batch, step


@pytest.mark.slow  # one of the longest checks: the default suite's time
def test_sliced_tasks_under_jax_set_mesh_train_as_on_one_device():
    """`parallelize` under ``jax.set_mesh``: its mesh is the step's, and the tasks' slices are its slices."""
    mesh = Mesh(np.asarray(jax.devices()[::-1], dtype=object).reshape(2, 4), ("stage", "data"))
    init, batch, step = explicit_problem(None, 1, lambda i: 1, rows="data")
    with jax.set_mesh(mesh):
        fn, state = check_mpmd_against_reference(step, init, batch, grad_rtol=2e-5)
    assert [p.name for p in fn.plan.placements] == ["embed", "stage0", "stage1"]
    assert [ids(p.devices) for p in fn.plan.placements] == [{3, 2, 1, 0}, {7, 6, 5, 4}, {3, 2, 1, 0}]
    assert ids(state["p"]["s1"]["a"].sharding.device_set) == {3, 2, 1, 0}


@pytest.mark.slow  # one of the longest checks: the default suite's time
def test_sliced_microbatched_tasks_under_an_auto_jax_set_mesh():
    """The same with microbatches: a task's outputs are typed on its slice, and JAX's transposes refuse to mix
    mesh sizes in one trace unless they come back to the caller's (Auto) mesh."""
    mesh = Mesh(np.asarray(jax.devices()[::-1], dtype=object).reshape(2, 4), ("stage", "data"))
    n_mb, slice_of = 4, lambda i: i % 2
    init, batch, step = explicit_problem("1f1b", n_mb, slice_of, rows="data")
    with jax.set_mesh(mesh):
        fn, state = check_mpmd_against_reference(step, init, batch, grad_rtol=2e-5)
    check_units_on_their_slices(fn, state, batch, mesh, "embed", n_mb, slice_of)


@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])  # gpipe: 12 s
def test_a_loop_dependent_embedding_runs_each_microbatch_on_its_slice(schedule):
    n_mb, slice_of = 4, lambda i: i % 2
    mm = MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    init, batch, step = explicit_problem(schedule, n_mb, slice_of)
    with mm:
        fn, state = check_mpmd_against_reference(step, init, batch, grad_rtol=2e-5)
    check_units_on_their_slices(fn, state, batch, mm.mesh, "embed", n_mb, slice_of)
    for i in range(2):  # each stage's parameters (and their optimizer state) stay on its slice
        for leaf in jax.tree.leaves(state["p"][f"s{i}"]) + jax.tree.leaves(state["o"][0].mu[f"s{i}"]):
            assert leaf.sharding.device_set == set(mm.mesh.devices[i].flat)
    # forward: just before the stage that reads it; backward: just after the stage that feeds it
    executed = fn.stats.executed
    for m in range(n_mb):
        assert executed.index(f"embed:fwd[mb {m}]") + 1 == executed.index(f"stage0:F[s0,m{m}]")
        assert executed.index(f"embed:bwd[mb {m}]") > executed.index(f"stage0:B[s0,m{m}]")


def test_a_loop_dependent_slice_that_never_changes_is_a_stage():
    mm = MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    init, batch, step = explicit_problem("1f1b", 2, lambda i: 0)
    with mm:
        fn, _ = check_mpmd_against_reference(step, init, batch, steps=1, grad_rtol=2e-5)
    assert fn.plan.schedule.num_stages == 3  # a stage of its own, as any task on a fixed submesh
    assert "embed:F[s0,m0]" in fn.stats.executed and "stage0:F[s1,m0]" in fn.stats.executed


@pytest.mark.parametrize("how", ["task", "callback"])
def test_a_registered_loop_dependent_embedding_of_a_linen_model(how):
    """``register_task(..., task=Task(loop_dependent_mesh_slice=...))`` (or a callback returning a new such
    Task per call): the Flax module ``embed`` of microbatch i runs on stage slice ``(i + 1) % 2``, the blocks
    on their stages' slices."""
    n_mb, slice_of = 4, lambda i: (i + 1) % 2
    mm = MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))

    def embed_task(*_):
        return Task(name="embed", loop_dependent_mesh_slice=lambda i: {"stage": slice_of(i)}, logical_axes=RULES)

    if how == "task":
        mm.register_task(r"embed", task=embed_task())
    else:
        mm.register_task(r"embed", callback=embed_task)
    mm.register_task(r"layers_(\d+)", callback=stage_of)
    init, batch, step = linen_problem(n_mb, "1f1b")
    with mm:
        fn, state = check_mpmd_against_reference(step, init, batch, grad_rtol=2e-5)
    check_units_on_their_slices(fn, state, batch, mm.mesh, "embed", n_mb, slice_of)


def test_a_flax_task_with_a_loop_dependent_slice():
    """``multimesh.jax.flax.task(nn.Embed, task=Task(loop_dependent_mesh_slice=...))``: the module's calls of
    microbatch i run on slice ``i % 2``."""
    n_mb, slice_of = 4, lambda i: i % 2
    mm = MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    mm.register_task(r"layers_(\d+)", callback=stage_of)
    with mm:
        embed = mmflax.task(nn.Embed, task=Task(name="embed", loop_dependent_mesh_slice=lambda i: {
            "stage": slice_of(i)}, logical_axes=RULES))
        init, batch, step = linen_problem(n_mb, "gpipe", embed=embed)
        fn, state = check_mpmd_against_reference(step, init, batch, grad_rtol=2e-5)
    check_units_on_their_slices(fn, state, batch, mm.mesh, "embed", n_mb, slice_of)
    table = state["p"]["params"]["embed"]["embedding"].value
    assert table.shape == (24, 16)  # the module's own parameter path


def test_every_iteration_slice_must_have_the_task_shape():
    with MultiMesh(axis_sizes=(2, 2, 2), axis_names=("a", "b", "c")):
        spec = Task(name="t", loop_dependent_mesh_slice=lambda i: {"a": 0} if i == 0 else {"b": 1})
        assert dict(spec.placement(iteration=0).mesh.shape) == {"a": 1, "b": 2, "c": 2}
        with pytest.raises(ValueError, match=r"Task\('t'\): loop_dependent_mesh_slice\(3\) = \{'b': 1\} gives a "
                                             r"submesh of shape \{'a': 2, 'b': 1, 'c': 2\}, the task's default slice "
                                             r"\{'a': 1, 'b': 2, 'c': 2\}; every iteration's slice must have the same"):
            spec.placement(iteration=3)
    with pytest.raises(ValueError, match=r"give mesh= or mesh_slice=/loop_dependent_mesh_slice=, not both"):
        Task(mesh=TaskMesh(devices=(0,)), loop_dependent_mesh_slice=lambda i: {"a": 0})
    with pytest.raises(TypeError, match=r"loop_dependent_mesh_slice must be a function iteration -> \{axis: index\}"):
        Task(loop_dependent_mesh_slice={"a": 0})
