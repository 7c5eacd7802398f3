"""What `auto_layout` sets aside before building or compiling, and the ``expert`` axis of a Mixture of Experts.

A layout whose parameters, optimizer state and batch alone overflow the memory limit is set aside unbuilt,
by a lower bound read from its rules (`multimesh.autolayout.bounds`): the search must choose what the
exhaustive one (every layout built, held bytes measured on the built step) chooses, and list every layout
set aside with its reason. A model whose parameters have an ``expert`` dimension is searched over an
``expert`` mesh axis too (sizes dividing its experts), priced with the all-to-alls that move its tokens; a
dense model never gets the axis.
"""

from __future__ import annotations

import pytest

import multimesh.autolayout.search as search_module
from multimesh.autolayout import ParallelLayout
from multimesh.autolayout.bounds import HeldArrays
from multimesh.autolayout.building import build_on, layout_rules
from multimesh.autolayout.checks import expert_misfit
from multimesh.autolayout.model_axes import model_names
from multimesh.autolayout.search import _search_axes
from multimesh.estimate import held_bytes

TINY = ["model.num_layers=1", "model.d_model=32", "model.max_len=32", "data.seq_len=32", "data.batch_size=8",
        "data.max_bytes=200000", "layout.mesh=auto", "layout.profile=h100-sxm"]
#: the moe config, smaller: one block of 8 experts
MOE = ["moe", "model.num_layers=1", "model.d_model=32", "model.d_ff=64", "model.max_len=32", "data.seq_len=32",
       "data.batch_size=8", "data.max_bytes=200000", "layout.mesh=auto", "layout.profile=h100-sxm",
       "layout.search.rules=[standard]"]


def _config(args):
    from trainers.config import load_config

    if args[0] == "moe":
        return load_config("moe", args[1:])
    return load_config("tiny", args)


def _train_functions(cfg):
    from trainers.layout_search import _microbatched
    from trainers.step import train_functions, zeros_batch

    f = train_functions(cfg, _microbatched, cfg.data.batch_size * cfg.data.seq_len)
    return f, (lambda: zeros_batch(cfg))


def _held_most(step_fn) -> int:
    held = held_bytes(step_fn.param_layout.leaves, step_fn.batch_layout.leaves)
    devices = set(held.params) | set(held.optimizer) | set(held.batch)
    return max(held.params.get(d, 0) + held.optimizer.get(d, 0) + held.batch.get(d, 0) for d in devices)


def test_the_bound_read_from_the_rules_is_what_the_built_step_holds():
    """The bound of a layout, read from another layout's built step and this one's rules, never exceeds what the
    step built on it holds (equal where every dimension divides), so a layout it sets aside would be rejected
    built."""
    import jax

    cfg = _config(TINY)
    f, batch = _train_functions(cfg)
    devices = jax.devices()[:8]
    kwargs = dict(init_params=f.init_state, get_input_batch=batch, quiet=True)
    first = HeldArrays.of(build_on(ParallelLayout({"data": 4, "fsdp": 2}), f.train_step, devices, None, **kwargs)[0])
    for mesh in ({"data": 8}, {"fsdp": 8}, {"fsdp": 2, "tensor": 4}, {"tensor": 8}):
        layout = ParallelLayout(mesh)
        held = _held_most(build_on(layout, f.train_step, devices, None, **kwargs)[0])
        bound = first.least_per_device(layout, layout_rules(layout))
        assert 0 < bound <= held, mesh
        if mesh != {"fsdp": 2, "tensor": 4}:  # the tiny model's dimensions divide 8
            assert bound == held, mesh


def _search(cfg, exhaustive: bool, monkeypatch):
    from trainers.config import ConfigError
    from trainers.layout_search import search_layout

    with monkeypatch.context() as patch:
        if exhaustive:  # no bound: every layout built, its held bytes measured; every rule set compiled
            patch.setattr(HeldArrays, "least_per_device", lambda self, layout, rules: 0)
            patch.setattr(search_module, "PRUNE_RATIO", float("inf"))
        try:
            return search_layout(cfg, progress=False)
        except ConfigError as e:
            return e.search


@pytest.mark.parametrize("args, fits", [
    # 8 devices over data and fsdp, a model whose parameters outweigh its activations: at a limit of 3 MiB,
    # data=8 holds more (its parameters and Adam's moments whole), the others are compiled, two fit
    ([*TINY, "layout.search.axes=[data, fsdp]", "model.d_model=128", "model.d_ff=512", "model.max_len=8",
      "data.seq_len=8", "layout.memory_limit=3145728"], True),
    # nothing fits: nothing is compiled
    ([*TINY, "layout.search.axes=[data, fsdp, tensor]", "layout.memory_limit=1000"], False),
    # with tensor axes and the sequence rules, some compiled only by the exhaustive search
    pytest.param([*TINY, "layout.search.axes=[data, tensor]", "model.d_model=128", "model.d_ff=512",
                  "model.max_len=8", "data.seq_len=8", "layout.memory_limit=3145728"], True, marks=pytest.mark.slow),
], ids=["some-fit", "none-fit", "sequence-rules"])
def test_the_search_with_the_bound_chooses_what_the_exhaustive_search_chooses(args, fits, monkeypatch):
    cfg = _config(args)
    pruned = _search(cfg, False, monkeypatch)
    exhaustive = _search(cfg, True, monkeypatch)
    assert sorted(c.layout.describe() for c in pruned.candidates) == \
        sorted(c.layout.describe() for c in exhaustive.candidates)
    by_layout = {c.layout: c for c in exhaustive.candidates}
    exhaustive_fitting = {c.layout: (c.time, c.peak_bytes) for c in exhaustive.fitting}
    assert all(exhaustive_fitting.get(c.layout) == (c.time, c.peak_bytes) for c in pruned.fitting), (pruned, exhaustive)
    assert bool(pruned.fitting) == fits
    if fits:
        assert pruned.best == exhaustive.best, f"{pruned}\n{exhaustive}"
    unbuilt = [c for c in pruned.candidates if (c.rejected or "").startswith("does not fit: at least")]
    assert unbuilt, "the bound set nothing aside: the test's limit should leave some layouts over it"
    for c in pruned.candidates:  # what the exhaustive search compiled and this one did not, it says why
        if c.estimate is None and by_layout[c.layout].estimate is not None:
            assert c.rejected.startswith(("does not fit: at least", "not compiled: its standard-rules twin"))
    for c in unbuilt:  # each rejected by the exhaustive search too, on at least the bytes the bound says
        twin = by_layout[c.layout]
        assert c.estimate is None and twin.rejected is not None and twin.peak_bytes >= c.peak_bytes
        assert f"({c.peak_bytes:,} B) per device" in c.rejected and c.layout.describe() in str(pruned)


def test_a_model_with_experts_is_searched_over_an_expert_axis_dividing_its_experts():
    f, _ = _train_functions(_config(MOE))
    named = model_names(f.init_state)
    assert named.sizes["expert"] == frozenset({8})
    assert _search_axes(None, named) == ("data", "fsdp", "expert", "tensor")
    dense, _ = _train_functions(_config(TINY))
    assert "expert" not in _search_axes(None, model_names(dense.init_state))
    with pytest.raises(ValueError, match="names 'expert', but no parameter of the model has an 'expert' dimension"):
        _search_axes(("data", "expert"), model_names(dense.init_state))
    experts = named.sizes["expert"]
    assert expert_misfit(ParallelLayout({"data": 2, "expert": 4}), experts) is None
    assert "expert=16 does not divide the model's 8 experts" in expert_misfit(ParallelLayout({"expert": 16}), experts)
    from trainers.layout_search import chosen_config  # the chosen expert layout trains as a config written so

    chosen = chosen_config(_config(MOE), ParallelLayout({"data": 2, "expert": 4})).layout
    assert chosen.mesh == {"data": 2, "expert": 4} and not chosen.is_auto


def test_a_dense_models_search_has_no_expert_axis(monkeypatch):
    from trainers.config import ConfigError

    cfg = _config([*TINY, "layout.memory_limit=1000"])  # nothing fits: one layout built, none compiled
    assert cfg.layout.search.axes is None
    found = _search(cfg, False, monkeypatch)
    assert len(found.candidates) > 10 and not any("expert" in c.layout.mesh for c in found.candidates)
    with pytest.raises(ConfigError, match=r"layout.search.axes=\['data', 'expert'\] names expert, but the model "
                                          r"has no experts"):
        _config([*TINY, "layout.search.axes=[data, expert]"])


def test_a_moe_search_prices_its_expert_layouts_with_their_all_to_alls(monkeypatch):
    """8 devices over data and expert: the expert layouts are compiled and priced, their all-to-alls among the
    collectives their step time counts."""
    cfg = _config([*MOE, "layout.search.axes=[data, expert]"])
    found = _search(cfg, False, monkeypatch)
    experts = [c for c in found.candidates if c.layout.mesh.get("expert", 1) > 1]
    assert {c.layout.mesh["expert"] for c in experts} == {2, 4, 8}
    for c in experts:
        assert c.rejected is None and c.time is not None and c.time > 0, (c.layout, c.rejected)
        a2a = {axes: counted for (kind, axes), counted in c.estimate.collectives().items() if kind == "all-to-all"}
        assert any("expert" in axes and count > 0 and size > 0 for axes, (count, size) in a2a.items()), \
            (c.layout, c.estimate.collectives())
        assert any(p.communication > 0 for p in c.estimate.time.programs.values())
    data8 = next(c for c in found.candidates if c.layout.mesh.get("expert", 1) == 1)
    assert not any(kind == "all-to-all" for kind, _ in data8.estimate.collectives())
    assert "expert=" in str(found)


def test_sequence_rules_are_not_compiled_where_the_standard_twin_is_slow_fitting_or_not():
    """The sequence rules save memory, not time: a twin priced far from the best sets them aside even where it
    is too big (they may make it fit, not make it the fastest); a twin near the best, or unpriced, does not."""
    from multimesh.autolayout.search import PRUNE_RATIO, Candidate, _pruned

    best = Candidate(ParallelLayout({"fsdp": 8}), time=1.0)
    sequence = ParallelLayout({"data": 2, "tensor": 4}, "sequence")
    twin = ParallelLayout({"data": 2, "tensor": 4})
    too_big = "device 0 needs 70 GiB at its peak, 10 GiB over the limit 60 GiB"
    slow_big = _pruned(sequence, [best, Candidate(twin, time=PRUNE_RATIO * 1.2, rejected=too_big)])
    assert slow_big is not None and slow_big.estimate is None
    assert slow_big.rejected == ("not compiled: its standard-rules twin (too big) is predicted 1.50x the best, and "
                                 "these rules save memory, not time")
    slow_fits = _pruned(sequence, [best, Candidate(twin, time=2.0)])
    assert slow_fits is not None and "twin fits and is predicted 2.00x the best" in slow_fits.rejected
    assert _pruned(sequence, [best, Candidate(twin, time=PRUNE_RATIO * 0.9, rejected=too_big)]) is None
    assert _pruned(sequence, [best, Candidate(twin, rejected="unpriced: compiling it killed XLA's compiler")]) is None
    assert _pruned(sequence, [Candidate(twin, time=5.0, rejected=too_big)]) is None  # nothing fits yet
