"""The public surface: `parallelize` returns one documented type, each public function is defined once,
and each public name has one meaning."""

from __future__ import annotations

import ast
import pathlib
import typing

import jax.numpy as jnp
import pytest

import multimesh.jax as mm
import multimesh.jax.flax as mmflax
from multimesh.jax import BatchStep, ParallelizeResult, StepAndInit, StepFunctions, StepOnly, parallelize

pytestmark = [pytest.mark.devices(8), pytest.mark.filterwarnings("ignore:parallelize. no rules=")]

PACKAGE = pathlib.Path(mm.__file__).resolve().parents[2]  # the folder holding multimesh/


def test_every_call_form_returns_a_named_tuple_of_the_one_documented_type():
    def step(p, b):
        return jnp.sum(b["x"] @ p["w"])

    def params():
        return {"w": jnp.ones((8, 8))}

    def batch():
        return {"x": jnp.ones((8, 8))}

    made = [parallelize(step, init_params=params, get_input_batch=batch, mesh={"data": 8}),
            parallelize(step, init_params=params, initial_batch=batch(), mesh={"data": 8}),
            parallelize(lambda b: jnp.sum(b["x"]), get_input_batch=batch, mesh={"data": 8}),
            parallelize(lambda b: jnp.sum(b["x"]), initial_batch=batch(), mesh={"data": 8})]
    assert [type(m) for m in made] == [StepFunctions, StepAndInit, BatchStep, StepOnly]
    assert all(isinstance(m, typing.get_args(ParallelizeResult)) and m._fields[0] == "step" for m in made)
    (only,) = made[-1]
    assert only is made[-1].step and float(only(batch())) == 64.0


def test_the_overloads_name_each_call_forms_type():
    forms = [typing.get_type_hints(f)["return"] for f in typing.get_overloads(parallelize)]
    assert forms == [StepFunctions, StepAndInit, BatchStep, StepOnly]
    assert typing.get_type_hints(parallelize)["return"] == ParallelizeResult


def _module_level_functions() -> dict[str, list[str]]:
    defined: dict[str, list[str]] = {}
    for path in sorted((PACKAGE / "multimesh").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not any(
                    "overload" in ast.unparse(d) for d in node.decorator_list):  # a typing.overload is no definition
                defined.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    return defined


def test_each_public_function_is_defined_once():
    defined = _module_level_functions()
    public = {name for ns in (mm, mmflax) for name in ns.__all__ if callable(getattr(ns, name))}
    assert {"parallelize", "task", "auto_layout"} <= public and "parallelize" in defined  # it looks where they are
    twice = {name: files for name, files in defined.items() if name in public and len(files) > 1}
    assert not twice, f"public functions defined in more than one module: {twice}"


def test_the_layout_search_candidate_has_its_own_name():
    from multimesh.core.layout import Layout

    assert mm.ParallelLayout is not Layout and not hasattr(mm, "Layout")
