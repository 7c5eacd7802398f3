"""What a newcomer is told: a mesh axis the standard rules leave unused is warned about
(``layout.mesh={dta: 8}``), and the layout configs change only ``layout``, as docs/trainer.md and
configs/tiny.yaml say."""

from __future__ import annotations

import warnings

import pytest
import yaml

from multimesh.core.rules import Rules
from trainers.config import CONFIG_DIR, load_config
from trainers.errors import ConfigWarning

LAYOUT_CONFIGS = ["dp", "fsdp", "tp", "dp_tp", "pipeline", "pipeline4"]


@pytest.mark.parametrize("mesh, axis, hint", [
    ("{dta: 8}", "'dta' (size 8)", "Did you mean 'data'?"),
    ("{data: 4, tnsor: 2}", "'tnsor' (size 2)", "Did you mean 'tensor'?"),
    ("{data: 2, tensor: 2, model: 2}", "'model' (size 2)", "tensor before model"),
])
def test_a_mesh_axis_no_standard_rule_uses_is_named(mesh, axis, hint):
    with pytest.warns(ConfigWarning) as caught:
        load_config("tiny", [f"layout.mesh={mesh}"])
    (message,) = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert f"layout.mesh axis {axis} is used by no rule of layout.rules=standard" in message
    assert hint in message and "rename the axis, or give layout.rules that use it" in message


def test_shipped_configs_and_size_one_axes_warn_about_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        for name in ["tiny", *LAYOUT_CONFIGS]:
            load_config(name)
        load_config("tiny", ["layout.mesh={data: 8, spare: 1}"])  # an axis of one device splits nothing
        load_config("tiny", ["layout.mesh={dta: 8}", "layout.rules=[[batch, dta]]"])  # rules of one's own


@pytest.mark.parametrize("name", LAYOUT_CONFIGS)
def test_layout_configs_change_only_layout(name):
    raw = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
    assert raw["base"] == "tiny" and set(raw) == {"base", "layout"}, sorted(raw)
    resolved, tiny = load_config(name).to_dict(), load_config("tiny").to_dict()
    assert {k: v for k, v in resolved.items() if k not in ("name", "layout")} == \
        {k: v for k, v in tiny.items() if k not in ("name", "layout")}


def test_microbatches_too_small_for_the_batch_axes_are_warned_about():
    # 64 rows in 64 microbatches on a stage mesh data=2 x tensor=2: a microbatch's one row cannot split over data
    with pytest.warns(ConfigWarning) as caught:
        cfg = load_config("pipeline", ["data.batch_size=64", "layout.pipeline.microbatches=64"])
    (message,) = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert ("layout.pipeline.microbatches=64 makes microbatches of 1 row (data.batch_size=64 / 64), which the batch "
            "axes data of layout.mesh={data: 2, tensor: 2} (2 ways) do not split") in message
    assert "the 2 devices along those axes compute the same rows" in message
    assert message.endswith("Use at most 32 microbatches, or data.batch_size=128")
    # what it says of the step: the rules leave a one-row batch dimension whole, and split a two-row one
    rules = Rules(cfg.layout.rule_pairs())
    assert rules.resolve(("batch", None), cfg.layout.mesh, (1, 128))[0] is None
    assert rules.resolve(("batch", None), cfg.layout.mesh, (2, 128))[0] == "data"
    with pytest.warns(ConfigWarning, match=r"microbatches of 3 rows .* Use at most 12 microbatches, or "
                                           r"data.batch_size=64$"):
        load_config("pipeline", ["data.batch_size=48", "layout.pipeline.microbatches=16"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config("pipeline", ["data.batch_size=64", "layout.pipeline.microbatches=32"])
        load_config("pipeline", ["data.batch_size=64", "layout.pipeline.microbatches=64", "layout.mesh={tensor: 4}"])
