"""``multimesh-train --platform`` (or ``$MULTIMESH_PLATFORM``, ``$JAX_PLATFORMS``): a run that asked for an
accelerator refuses to train on CPU, saying how to install JAX for it. This machine's JAX runs on CPU."""

from __future__ import annotations

import jax
import pytest

from trainers.platform_check import PlatformError, asked_platform, check_platform


def test_the_platform_asked_for_comes_from_the_flag_then_the_variables():
    env = {"MULTIMESH_PLATFORM": "tpu", "JAX_PLATFORMS": "cuda"}
    assert asked_platform("gpu", env) == ("gpu", "--platform gpu")
    assert asked_platform(None, env) == ("tpu", "MULTIMESH_PLATFORM=tpu")
    assert asked_platform(None, {"JAX_PLATFORMS": "cuda"}) == ("gpu", "JAX_PLATFORMS=cuda")
    assert asked_platform(None, {"JAX_PLATFORMS": "cuda,cpu"}) == ("any", "")  # a fallback: either may run
    assert asked_platform(None, {}) == ("any", "")
    with pytest.raises(PlatformError, match="MULTIMESH_PLATFORM=gpus: give one of any, cpu, gpu, tpu"):
        asked_platform(None, {"MULTIMESH_PLATFORM": "gpus"})


def test_cpu_or_any_runs_here():
    assert jax.default_backend() == "cpu"
    assert check_platform("any") == check_platform("cpu") == "cpu"


@pytest.mark.parametrize(("asked", "install"), [("gpu", 'pip install ".[cuda13]" -c requirements/lock.txt'),
                                                ("tpu", 'pip install ".[tpu]" -c requirements/lock.txt -f ')])
def test_an_accelerator_asked_for_on_cpu_is_refused_with_how_to_install_it(asked, install):
    with pytest.raises(PlatformError) as caught:
        check_platform(asked, f"--platform {asked}")
    message = str(caught.value)
    assert message.startswith(f"asked to run on {asked} (--platform {asked}), but JAX runs on cpu (cpu). ")
    assert install in message and "docs/install.md" in message


def test_the_trainer_stops_before_training(tmp_path, capsys):
    from trainers.cli import main

    assert main(["tiny", f"train.out_dir={tmp_path / 'run'}", "--platform", "gpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("multimesh-train: asked to run on gpu (--platform gpu), but JAX runs on cpu")
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written
