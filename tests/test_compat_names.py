"""Every name of MultiMesh for JAX's public API (../shared/MULTIMESH_REFERENCE.md) is provided by
`multimesh.jax` (or `multimesh.jax.flax`) or listed in MIGRATING.md as unsupported; every name
provided is described there."""

import pathlib
import re

import multimesh.jax as mm
from multimesh.jax import flax as mmflax

MIGRATING = (pathlib.Path(__file__).resolve().parent.parent / "MIGRATING.md").read_text()

V01 = ["no_op_custom_call", "shutdown", "replicate_parameters_smaller_than_num_elements",
       "recompute_from_arguments_if_cost_less_than", "clear_tasks", "compile_hlo_module", "set_startup_config",
       "register_custom_call_target", "autoshard", "context", "enable_fast_path", "enable_recomputation",
       "enable_task_fusion", "only_fuse_loop_tasks", "ignore_transforms", "with_sharding_constraint", "tasks",
       "mjit", "task", "microbatch", "parallelize", "register_task", "MeshWrapper", "__version__"]
V02 = ["shard_map", "custom_partitioning", "slice_global_mesh", "Task", "TaskMesh", "Context", "MultiMesh"]
FLAX = ["task", "shard_axes", "parallelize_step", "with_sharding_constraint"]
PLUGIN = ["jax_plugins.multimesh.init", "init_test", "jax_plugins.multimesh.initialize"]


def row_of(name: str) -> str:
    """The MIGRATING.md table row whose first cell names ``name`` (in backquotes), as its status cell."""
    rows = [line for line in MIGRATING.splitlines()
            if line.startswith("| ") and re.search(rf"`{re.escape(name)}[(`]", line.split("|")[1])]
    assert rows, f"MIGRATING.md has no row for {name!r}"
    return rows[0].split("|")[-2].strip()


def test_every_reference_name_is_provided_or_listed_as_unsupported():
    for name in V01 + V02:
        status = row_of(name)
        if hasattr(mm, name):
            assert name in mm.__all__, name
            assert not status.startswith("**unsupported**"), f"{name} is provided but listed as unsupported"
        else:
            assert status.startswith("**unsupported**"), f"{name} is neither in multimesh.jax nor listed as unsupported"
    for name in FLAX:
        assert hasattr(mmflax, name) and name in mmflax.__all__, name
        row_of(name)
    for name in PLUGIN:
        assert row_of(name).startswith("**unsupported**"), name


def test_the_compat_names_are_all_provided():
    provided = [n for n in V01 + V02 if hasattr(mm, n)]
    missing = sorted(set(V01 + V02) - set(provided))
    assert missing == ["MeshWrapper", "compile_hlo_module", "no_op_custom_call", "recompute_from_arguments_if_cost_less_than",
                       "register_custom_call_target", "replicate_parameters_smaller_than_num_elements",
                       "set_startup_config"]
