"""The "Tested on" line of README.md and multimesh/_compat/README.md is generated (`.ci/tested_on.py`) from what
CI runs: the lock (requirements/lock.txt, the default suite's versions) and pyproject.toml's lower bounds (the smoke
subset's, .ci/lowest.sh). A hand edit of either file, or a lock refreshed without the line, fails here."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("tested_on", REPO / ".ci" / "tested_on.py")
tested_on = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tested_on)


@pytest.mark.parametrize("name", tested_on.FILES)
def test_the_tested_on_line_is_the_generated_one(name):
    expected = tested_on.line()
    lines = [x for x in (REPO / name).read_text().splitlines() if x.startswith(tested_on.PREFIX)]
    assert lines == [expected], f"{name}: run python .ci/tested_on.py --write"


def test_the_line_names_the_lock_as_the_newest_end_and_the_lower_bounds_as_the_lowest():
    lock = {"jax": "0.13.2", "jaxlib": "0.13.2", "flax": "0.13.0", "optax": "0.2.9", "orbax-checkpoint": "0.13.1"}
    low = {"jax": "0.11", "jaxlib": "0.11", "flax": "0.12.7", "optax": "0.2.5", "orbax-checkpoint": "0.12.3"}
    assert tested_on.line(lock, low).startswith("Tested on jax/jaxlib 0.11.0 to 0.13.2, flax 0.12.7 to 0.13.0, "
                                                "optax 0.2.5 to 0.2.9 and orbax-checkpoint 0.12.3 to 0.13.1: ")
    with pytest.raises(SystemExit, match="jax and jaxlib differ"):
        tested_on.line({**lock, "jaxlib": "0.13.1"}, low)


def test_the_lock_pins_every_dependency_within_pyproject_ranges():
    pins = tested_on.locked()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dep in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        req = Requirement(dep)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"requirements/lock.txt pins no {req.name}: bash .ci/lock.sh"
        assert req.specifier.contains(pins[name]), f"the lock's {name}=={pins[name]} is outside {dep!r}"
    assert "multimesh" not in pins


def test_the_accelerator_extras_pull_jax_own_wheels_within_the_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    jax_range = next(Requirement(d).specifier for d in project["dependencies"] if Requirement(d).name == "jax")
    for extra in ("cuda12", "cuda13", "tpu"):
        [dep] = [Requirement(d) for d in project["optional-dependencies"][extra]]
        assert (dep.name, dep.extras, dep.specifier) == ("jax", {extra}, jax_range), dep
