"""The layout search on public model code (the vendored models of ``test_thirdparty_models.py``), as a user
would call it: ``parallelize(step, layout="auto", ...)`` on the model as it is.

Two of them name mesh axes themselves: nanodo's parameters are sharded over ``data``
(``nn.with_partitioning``), and the Gemma example's over ``fsdp`` and ``tp`` (NNX ``out_sharding``
metadata), which its code names again in ``einsum(..., out_sharding=P(...))`` on Explicit axes. Every
mesh the search tries must have those axes. Each chosen layout trains 3 steps that equal the same steps
on one device (losses, parameters and optimizer state), and its shardings are checked on the arrays.
"""

from __future__ import annotations

import contextlib

import jax
import pytest
import test_thirdparty_models as T

from multimesh.autolayout import auto_layout
from multimesh.autolayout.layouts import ParallelLayout
from multimesh.autolayout.model_axes import model_axes
from multimesh.core.meshes import spec_names
from multimesh.jax import parallelize, register_task, stage_task

pytestmark = pytest.mark.devices(8)

PROFILE = "h100-sxm"
#: the mesh axes each model's parameters name themselves
OWN_AXES = {"flax_lm1b": (), "flax_wmt": (), "nanodo": ("data",), "flax_gemma": ("fsdp", "tp"),
            "flax_on_pjit": ()}


def _search_kwargs(m: T.Model) -> dict:
    return {"init_params": m.init, "get_input_batch": m.batch, "profile": PROFILE, "rule_sets": ("standard",),
            **({"param_rules": m.param_rules} if m.param_rules else {})}


def _assert_built_on(name: str, layout: ParallelLayout, built, state) -> None:
    """Every array of the state and the batch lies on the layout's whole mesh, and each axis it splits
    shards some array."""
    with T.model(name).context():
        arrays = jax.tree.leaves((state, built[2]()))
    assert {tuple(a.sharding.mesh.shape.items()) for a in arrays} == {tuple(layout.whole_mesh.items())}
    used = set().union(*(spec_names(a.sharding.spec) for a in arrays))
    assert {a for a, n in layout.mesh.items() if n > 1} <= used, (layout, used)


@pytest.mark.parametrize("name", list(OWN_AXES))
def test_model_axes_are_the_ones_its_parameters_name(name):
    assert model_axes(T.model(name).init) == OWN_AXES[name]


#: the Linen models with logical names only, like this repository's own (`test_autolayout.py`): 25 s each;
#: Gemma's search, 10 s (its explicit-sharding search stays in the default suite, below)
_LONG = ("flax_lm1b", "flax_wmt", "flax_gemma", "nanodo")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _LONG else n for n in OWN_AXES])
def test_auto_layout_equals_one_device(name, capfd):
    """The search on the model as it is, then the layout that shards the most (the least peak memory,
    forced by memory_limit=) built by parallelize(layout="auto") and trained against one device."""
    m = T.model(name)
    with m.context():
        search = auto_layout(T.make_step(m.loss), **_search_kwargs(m))
    for c in search.candidates:  # the model's own axes are on every mesh tried, of size 1 where not split
        assert set(OWN_AXES[name]) <= set(c.layout.mesh), c.layout
    # a data x fsdp mesh set aside as data by other names names a layout that was tried; never where the
    # model shards its parameters over data itself (nanodo's FSDP)
    tried = {c.layout.describe(): c for c in search.candidates}
    for c in search.candidates:
        if c.rejected and "splits only the batch, as data does" in c.rejected:
            assert "data" not in OWN_AXES[name]
            assert tried[c.rejected.rsplit("the same layout as ", 1)[1]].valid
    # XLA's resharding warnings are the table's, each with its layout, not stderr's
    resharding = [c.layout.describe() for c in search.candidates if c.estimate is not None and c.estimate.reshards]
    notes = [line for line in str(search).splitlines() if line.startswith("note: XLA reshards")]
    assert all(f"{d} (" in notes[0] for d in resharding) if resharding else not notes
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    least = min(search.fitting, key=lambda c: c.peak_bytes)
    with m.context():
        built = parallelize(T.make_step(m.loss), layout="auto", memory_limit=least.peak_bytes, **_search_kwargs(m))
    chosen = built[0].layout_search.best
    assert built[0].layout_search.best_candidate.peak_bytes == least.peak_bytes
    losses, state = T.run(name, built, T.SAVE_AT)
    T.assert_matches_reference(name, losses, state)
    _assert_built_on(name, chosen, built, state)


@pytest.mark.slow  # one of the longest checks: the default suite's time
def test_explicit_sharding_code_without_a_mesh_in_context():
    """The Gemma example's code names Explicit axes: with no mesh in context every candidate fails, and the
    error says what to pass; with axis_types="explicit" the model's own axes are Explicit and the search
    runs."""
    m = T.model("flax_gemma")
    with pytest.raises(ValueError, match=r"uses JAX's explicit sharding.*axis_types='explicit'.*No layout could "
                                         r"be built; the step's error above says what to change$"):
        auto_layout(T.make_step(m.loss), **_search_kwargs(m))
    built = parallelize(T.make_step(m.loss), layout="auto", axis_types="explicit", **_search_kwargs(m))
    assert built[0].layout_search.explicit_axes == frozenset({"fsdp", "tp"})
    losses, state = T.run("flax_gemma", built, T.SAVE_AT)
    T.assert_matches_reference("flax_gemma", losses, state)
    _assert_built_on("flax_gemma", built[0].layout_search.best, built, state)


def test_axes_may_name_the_models_own():
    m = T.model("flax_gemma")
    with m.context():
        search = auto_layout(T.make_step(m.loss), axes=("fsdp", "tp"), **_search_kwargs(m))
    meshes = sorted((c.layout.mesh["fsdp"], c.layout.mesh["tp"]) for c in search.candidates)
    assert meshes == [(1, 8), (2, 4), (4, 2), (8, 1)]
    with pytest.raises(ValueError, match=r"axes=\('fsdp', 'mp'\).*the model's parameters name 'fsdp', 'tp'"):
        auto_layout(T.make_step(m.loss), axes=("fsdp", "mp"), **_search_kwargs(m))


def test_rules_for_the_models_own_logical_names():
    """Flax's guide names its MLP's hidden dimension "hidden", which the standard rules do not know: without
    a rule no tensor-parallel layout is valid; with rules=[("hidden", "tensor")] they are, and the one that
    shards the most trains as on one device."""
    m = T.model("flax_on_pjit")
    step = T.make_step(m.loss)
    plain = auto_layout(step, **_search_kwargs(m))
    assert not any(c.layout.mesh.get("tensor", 1) > 1 for c in plain.fitting)
    tensor = [c for c in plain.candidates if c.layout.mesh.get("tensor", 1) > 1]
    assert tensor and all("no rule maps the model's own logical names 'hidden', 'layer' to an axis: give them "
                          "rules=, e.g. rules=[('hidden', 'tensor')]" in c.rejected for c in tensor)
    own = [("hidden", "tensor"), ("layer", None)]
    search = auto_layout(step, rules=own, **_search_kwargs(m))
    assert any(c.layout.mesh.get("tensor", 1) > 1 for c in search.fitting)
    least = min(search.fitting, key=lambda c: c.peak_bytes)
    assert least.layout.mesh.get("tensor", 1) > 1, least.layout
    built = parallelize(step, layout="auto", rules=own, memory_limit=least.peak_bytes, **_search_kwargs(m))
    losses, state = T.run("flax_on_pjit", built, T.SAVE_AT)
    T.assert_matches_reference("flax_on_pjit", losses, state)
    _assert_built_on("flax_on_pjit", least.layout, built, state)
    with pytest.raises(ValueError, match=r"\('hidden', 'model'\) in rules= names mesh axis 'model', which no mesh"):
        auto_layout(step, rules=[("hidden", "model")], **_search_kwargs(m))


def test_an_axis_its_arrays_cannot_use_is_set_aside_without_building(monkeypatch):
    """Once one layout is built, the search knows what the step's arrays call their dimensions: a layout
    with an axis that none of them can be sharded over (the guide's model has no rule for its 'hidden') is
    set aside unbuilt, for the reason that building it would give."""
    import multimesh.autolayout.search as search_module

    m = T.model("flax_on_pjit")
    built = []
    build_on = search_module.build_on
    monkeypatch.setattr(search_module, "build_on",
                        lambda layout, *a, **k: built.append(layout) or build_on(layout, *a, **k))
    pruned = auto_layout(T.make_step(m.loss), **_search_kwargs(m))
    pruned_builds = len(built)
    monkeypatch.setattr(search_module, "idle_by_names", lambda *a: None)  # every layout built, as before
    every = auto_layout(T.make_step(m.loss), **_search_kwargs(m))
    assert [(c.layout, c.rejected, c.peak_bytes) for c in pruned.candidates] == \
        [(c.layout, c.rejected, c.peak_bytes) for c in every.candidates]
    idle = [c for c in every.candidates if c.rejected and "shards no parameter" in c.rejected]
    assert idle and len(built) - pruned_builds == len(every.candidates)
    assert pruned_builds <= len(every.candidates) - len(idle) + 1  # only the first layout built, if idle


@pytest.mark.slow  # about 40 s: every 2-stage layout compiled and estimated
def test_gemma_pipelines_are_searched_and_the_chosen_one_equals_one_device():
    """2-stage layouts of the Gemma example (its layers registered on the stages with stage_task): on
    Explicit axes its embedding's values cross stages typed on Auto axes, which the estimate follows."""
    m = T.model("flax_gemma")

    @contextlib.contextmanager
    def stages(count: int, chunks: int):
        with contextlib.ExitStack() as registered:
            for i, pattern in enumerate(m.stages):
                registered.enter_context(register_task(pattern, callback=lambda *_, i=i: stage_task(i * count // 2)))
            yield

    with m.context():
        built = parallelize(T.make_step(m.loss, T.MICROBATCHES), layout="auto", pipeline=stages, stage_counts=(2,),
                            microbatches=(T.MICROBATCHES,), schedules=("1f1b",), **_search_kwargs(m))
    search = built[0].layout_search
    assert search.best.stages == 2 and len(search.fitting) >= 4
    losses, state = T.run("flax_gemma", built, T.SAVE_AT)
    T.assert_matches_reference("flax_gemma", losses, state)
