"""The checkpoint inspector and the sharding report spell leaf paths alike.

A Flax box (Linen ``LogicallyPartitioned``, NNX ``Variable``) is one row of ``step_fn.report()``,
``params/Dense_0/kernel``; its array's key path runs through the box's ``value`` attribute. Each
direction is checked: every path of the report is a path of the inspector and every path of the
inspector one of the report, for a checkpoint written now and for one whose manifest has no names
(as written before names were recorded), which also still restores.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from multimesh.checkpoint import CheckpointManager, CheckpointMismatchError
from multimesh.checkpoint import inspect as ckpt_inspect
from multimesh.jax import parallelize

MESH = {"data": 4, "model": 2}
RULES = [("batch", "data"), ("embed", None), ("mlp", "model")]
BATCH = {"x": np.ones((8, 4), np.float32)}


class LinenMlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        up = nn.Dense(16, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))
        return nn.Dense(1)(nn.relu(up(x)))  # the second layer unboxed: both kinds of leaf


class NnxMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.up = nnx.Linear(4, 16, kernel_init=kernel, rngs=rngs)
        self.down = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def _linen_step():
    model = LinenMlp()
    return parallelize(lambda p, b: jnp.sum(model.apply(p, b["x"])),
                       init_params=lambda: model.init(jax.random.key(0), BATCH["x"]),
                       initial_batch=BATCH, mesh=MESH, rules=RULES)


def _nnx_step():
    with nnx.use_eager_sharding(False):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: NnxMlp(nnx.Rngs(0))), nnx.Param)
    return parallelize(lambda p, b: jnp.sum(nnx.merge(graphdef, p)(b["x"])),
                       init_params=lambda: nnx.state(NnxMlp(nnx.Rngs(0)), nnx.Param),
                       initial_batch=BATCH, mesh=MESH, rules=RULES)


def _inspected_paths(directory, capsys) -> list[str]:
    """The path column of ``multimesh-ckpt DIR 1``."""
    capsys.readouterr()
    assert ckpt_inspect.main([str(directory), "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("tree: ")) + 3  # title, header, rule
    end = lines.index("", start)
    return [line.split()[0] for line in lines[start:end]]


def _forget_names(directory) -> None:
    """Rewrites step 1's manifest as multimesh wrote it before leaves had names."""
    doc_file = directory / "1" / "multimesh" / "metadata"
    doc = json.loads(doc_file.read_text())
    for record in doc["tree"]["leaves"]:
        assert "name" in record
        del record["name"]
    doc_file.write_text(json.dumps(doc))


def _subtree(tree, name: str):
    for key in name.split("/"):
        tree = tree[key]
    return tree


def _check_both_ways(build, tmp_path, capsys) -> None:
    step_fn, init = build()
    reported = [row[0] for row in step_fn.report().rows()]
    kernel = next(p for p in reported if p.endswith("up/kernel") or p.endswith("Dense_0/kernel"))  # a box
    params = init()
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, params)
        assert f"{kernel}/value" in [r.path for r in mgr.info(1).leaves]  # saved through the box's attribute
    assert sorted(_inspected_paths(tmp_path / "c", capsys)) == sorted(reported)  # both ways: the same set

    _forget_names(tmp_path / "c")
    assert sorted(_inspected_paths(tmp_path / "c", capsys)) == sorted(reported)
    with CheckpointManager(tmp_path / "c", read_only=True) as mgr:  # an older manifest still restores
        restored = mgr.restore(target=step_fn).state
        box = mgr.restore(target=_subtree(step_fn.abstract_params, kernel), path=kernel).state  # by its name
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(jax.tree.leaves(box)[0]),
                                  np.asarray(jax.tree.leaves(_subtree(params, kernel))[0]))


def test_linen_boxes_read_alike_in_report_and_inspector(tmp_path, capsys):
    _check_both_ways(_linen_step, tmp_path, capsys)


def test_nnx_variables_read_alike_in_report_and_inspector(tmp_path, capsys):
    _check_both_ways(_nnx_step, tmp_path, capsys)


def test_a_dictionary_key_named_value_keeps_its_name(tmp_path, capsys):
    """Names are recorded from the tree's own boxes: a plain key ``value`` is no box attribute."""
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, {"counter": {"value": jax.device_put(np.arange(4.0))}, "w": jax.device_put(np.ones(2))})
    assert _inspected_paths(tmp_path / "c", capsys) == ["counter/value", "w"]


class WiderLinenMlp(nn.Module):
    """`LinenMlp` with a wider hidden layer and a renamed output layer: a restore target that does not match."""

    @nn.compact
    def __call__(self, x):
        up = nn.Dense(32, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))
        return nn.Dense(1, name="out")(nn.relu(up(x)))


def test_a_mismatched_restore_names_leaves_as_the_report_does(tmp_path):
    step_fn, init = _linen_step()
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, init())
    model = WiderLinenMlp()
    wider, _ = parallelize(lambda p, b: jnp.sum(model.apply(p, b["x"])),
                           init_params=lambda: model.init(jax.random.key(0), BATCH["x"]),
                           initial_batch=BATCH, mesh=MESH, rules=RULES)
    reported = {row[0] for row in wider.report().rows()} | {row[0] for row in step_fn.report().rows()}
    with CheckpointManager(tmp_path / "c", read_only=True) as mgr, pytest.raises(CheckpointMismatchError) as err:
        mgr.restore(target=wider)
    e = err.value
    assert sorted(m[:2] for m in e.mismatched) == [("params/Dense_0/bias", "shape"), ("params/Dense_0/kernel", "shape")]
    assert sorted(p.split()[0] for p in e.unexpected) == ["params/out/bias", "params/out/kernel"]
    assert "nearest saved: params/Dense_1/" in str(e)
    # every leaf the message names is a row of a report, none spelled through the box's ``value``
    named = [m[0] for m in e.mismatched] + [p.split()[0] for p in e.unexpected + e.missing]
    assert set(named) <= reported and "/value" not in str(e)
