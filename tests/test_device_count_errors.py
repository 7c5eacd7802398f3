"""A layout that needs more devices than the run has: the fix suggested is one that can be given."""

from __future__ import annotations

import pytest

from trainers.config import ConfigError
from trainers.fit import check_devices


def test_fewer_devices_than_stages_suggests_no_mesh_of_size_zero():
    """``multimesh-train pipeline --plan --num-devices 1``: 2 stages on 1 device. No ``{data: 0}``: the
    fix is dropping the pipeline, or more devices."""
    with pytest.raises(ConfigError) as raised:
        check_devices({"data": 1}, 2, 1)
    message = str(raised.value)
    assert "at most 0" not in message and "{data: 0}" not in message, message
    assert "fewer than the 2 pipeline stages" in message and "layout.pipeline=null" in message, message


def test_fewer_devices_than_stages_but_two_suggests_fewer_stages():
    with pytest.raises(ConfigError, match=r"fewer than the 4 pipeline stages; give at most "
                                          r"layout.pipeline.stages=3") as raised:
        check_devices({"data": 2}, 4, 3)
    assert "at most 0" not in str(raised.value)


def test_a_mesh_too_large_for_its_stages_suggests_the_largest_that_fits():
    with pytest.raises(ConfigError, match=r"whose product is at most 2 per pipeline stage, e\.g\. "
                                          r"layout.mesh='\{data: 2\}'"):
        check_devices({"data": 4}, 2, 4)


def test_plan_profile_is_the_layout_search_s_profile(capsys):
    """``multimesh-train tiny layout.mesh=auto --plan --profile h100-sxm``: the search takes the flag's profile
    (it used to ask for layout.profile, the flag given); an unknown one names the flag."""
    from trainers.cli import main

    assert main(["tiny", "layout.mesh=auto", "--plan", "--profile", "h100-sxm", "--print-config"]) == 0
    assert "profile: h100-sxm" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["tiny", "layout.mesh=auto", "--plan", "--profile", "h999", "--print-config"])
    assert stop.value.code == 2 and "--profile h999" in capsys.readouterr().err
