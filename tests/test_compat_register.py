"""MultiMesh compatibility of `register_task`.

A callback receives the matched text (a str, ``name.split("_")``) and may
return a `Task`; ``devices=`` takes integer ids, shaped by ``dims=`` without a
callback; ``task=Task(...)`` gives the placement as data.
"""

import re

import jax
import pytest
from jax.sharding import PartitionSpec as P

from multimesh.jax import MatchedName, Task, TaskMesh, clear_tasks, register_task

pytestmark = pytest.mark.devices(8)


@pytest.fixture(autouse=True)
def _no_leftover_tasks():
    yield
    clear_tasks()


def place(reg, name: str, backprop: bool = False):
    return reg.placement_for(reg.pattern.fullmatch(name), backprop)


def test_callback_gets_the_matched_text_as_a_str():
    seen = []

    def where(name, backprop):
        seen.append((type(name), name, backprop))
        layer = int(name.split("_")[1])  # the MultiMesh tutorials' parsing
        return ((0, 4) if layer < 2 else (4, 8)), f"stage{layer // 2}"

    reg = register_task(r"layers_(\d+)", callback=where)
    p = place(reg, "layers_3", True)
    assert seen == [(MatchedName, "layers_3", True)]
    assert isinstance(seen[0][1], str) and seen[0][1] + "" == "layers_3"
    assert p.name == "stage1" and p.devices == frozenset(jax.devices()[4:])


def test_matched_name_still_offers_match_groups():
    name = MatchedName(re.fullmatch(r"layers_(?P<n>\d+)", "layers_12"))
    assert name == "layers_12" and name[0] == "l"  # a str's indexing, not a Match's
    assert name.group(0) == "layers_12" and name.group(1) == "12" and name.groups() == ("12",)
    assert name.groupdict() == {"n": "12"} and name.match.span() == (0, 9)


def test_integer_ids_with_dims_and_no_callback():
    devs = jax.devices()
    reg = register_task("layer0", devices=[0, 1, 2, 3], dims=[2, 2], device_axes=["x", "y"])
    p = place(reg, "layer0")
    assert p.mesh.devices.tolist() == [[devs[0], devs[1]], [devs[2], devs[3]]]
    assert p.mesh.axis_names == ("x", "y")
    reg = register_task("layer1", devices=[5], dims=[1, 1], device_axes=["x", "y"])
    assert place(reg, "layer1").mesh.devices.tolist() == [[devs[5]]]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"devices": [0, 99]}, ValueError, r"device id 99 does not exist"),
    ({"devices": [0, 0]}, ValueError, r"devices \[0\] appear more than once"),
    ({"devices": ["gpu0"]}, TypeError, r"devices must be jax devices or integer ids, got 'gpu0'"),
    ({"devices": [0, 1, 2], "dims": [2, 2], "device_axes": ["x", "y"]}, ValueError,
     r"register_task\('layer0'\): dims=\(2, 2\) needs 4 devices, but devices= holds 3"),
    ({"dims": [2, 2], "device_axes": ["x", "y"]}, ValueError, r"dims=\(2, 2\) shapes devices=; give devices= too"),
    ({"devices": [0, 1], "task": Task()}, ValueError, r"task= says where matches run; give it alone"),
])
def test_misuse_is_a_clear_error(kwargs, error, message):
    with pytest.raises(error, match=message):
        register_task("layer0", **kwargs)


def test_register_a_task_and_a_callback_returning_one():
    devs = jax.devices()
    mesh = TaskMesh(devices=(4, 5, 6, 7), axis_sizes=(2, 2), axis_names=("x", "y"))
    reg = register_task(r"head", task=Task(mesh=mesh, logical_axes=[("batch", "x")], name="last"))
    p = place(reg, "head")
    assert p.name == "last" and p.mesh.devices.tolist() == [[devs[4], devs[5]], [devs[6], devs[7]]]
    assert p.spec(("batch", None), (8, 4)) == P("x", None)

    def where(name, backprop):
        layer = int(name.group(1))
        return Task(mesh=TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(2, 2)).place(
            range(4 * layer, 4 * layer + 4)), name=f"stage{layer}")

    reg = register_task(r"layers_(\d)", callback=where)
    p1 = place(reg, "layers_1")
    assert p1.name == "stage1" and p1.devices == frozenset(devs[4:]) and dict(p1.mesh.shape) == {"x": 2, "y": 2}


def test_tasks_holds_only_the_registrations_the_configurable_makes():
    from multimesh.jax import registered_tasks, tasks

    before = register_task("kept", devices=[0])

    def configurable():
        return lambda: register_task("inside", devices=[1])

    with tasks(configurable):
        assert [r.pattern.pattern for r in registered_tasks()] == ["inside"]
    assert registered_tasks() == [before]


def test_loop_dependent_slices_are_checked():
    from multimesh.jax import MultiMesh

    mm = MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    with mm:
        same = register_task("a", task=Task(loop_dependent_mesh_slice=lambda i: {"stage": 1}))
        m = same.pattern.fullmatch("a")
        assert same.placement_for(m, False, 3).devices == frozenset(jax.devices()[4:])
        rotating = register_task("b", task=Task(loop_dependent_mesh_slice=lambda i: {"stage": i % 2}))
        m = rotating.pattern.fullmatch("b")
        assert rotating.placement_for(m, False, 0).devices == frozenset(jax.devices()[:4])
        assert rotating.placement_for(m, False, 1).devices == frozenset(jax.devices()[4:])  # its own slice
        assert rotating.placement_for(m, False, None).devices == frozenset(jax.devices()[:4])  # outside a loop: i=0
        other_axis = register_task("d", task=Task(mesh_slice={"stage": 0}, loop_dependent_mesh_slice=lambda i: (
            {"stage": 0} if i == 0 else {"data": 0})))
        with pytest.raises(ValueError, match=r"loop_dependent_mesh_slice\(1\) = \{'data': 0\} gives 2 devices"):
            other_axis.placement_for(other_axis.pattern.fullmatch("d"), False, 1)
        uneven = register_task("c", task=Task(mesh_slice={"stage": 0},
                                              loop_dependent_mesh_slice=lambda i: {"stage": 0, "data": 0}))
        with pytest.raises(ValueError, match=r"gives 1 devices, the task's default slice 4"):
            uneven.placement_for(uneven.pattern.fullmatch("c"), False, 2)


def test_relative_device_numbers_follow_the_global_mesh_in_force():
    from multimesh.jax import MultiMesh

    reg = register_task("a", task=Task(mesh=TaskMesh(devices=(0, 1))))
    m = reg.pattern.fullmatch("a")
    assert reg.placement_for(m, False).devices == frozenset(jax.devices()[:2])
    from multimesh.trace.implicit import implicit_placement

    assert implicit_placement("a").devices == frozenset(jax.devices()[:2])
    with MultiMesh(devices=jax.devices()[::-1]):  # the global mesh's devices, in its order
        assert reg.placement_for(m, False).devices == frozenset(jax.devices()[6:])
        assert implicit_placement("a").devices == frozenset(jax.devices()[6:])
    assert implicit_placement("a").devices == frozenset(jax.devices()[:2])

