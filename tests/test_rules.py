"""Tests for the logical-axis rule engine (`multimesh.core.rules`) and `Placement`.

Everything here is pure Python except the `Placement` tests, which build a mesh on
the simulated CPU devices of conftest.py.

Tests whose name starts with ``test_BUG_`` document library bugs found while
writing this file; they fail until the library is fixed (see each docstring).
"""

from __future__ import annotations

import itertools
import math
import re
import warnings
from typing import ClassVar

import flax.linen as nn
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh.core.placement import Placement, current_placement, use_placement
from multimesh.core.rules import (
    RULE_SETS,
    Dropped,
    PathRules,
    Resolution,
    RuleError,
    Rules,
    RuleWarning,
    check_physical,
    identity_rules,
    named_rules,
    resolution,
    resolve,
    standard_rules,
)

U = P.UNCONSTRAINED

# The mesh and rules of the module docstring's worked examples.
DOC_MESH = {"data": 4, "fsdp": 2, "model": 2}
DOC_RULES = [("batch", "data"), ("batch", "fsdp"), ("embed", "fsdp"), ("mlp", "model")]


def norm(spec, n: int | None = None) -> tuple:
    """Canonical form of a (resolved) spec: a tuple, one entry per dimension,
    ``()``/missing -> None, single-axis tuples -> the bare axis name."""
    entries = list(spec)
    if n is not None:
        assert len(entries) <= n
        entries += [None] * (n - len(entries))
    out = []
    for e in entries:
        if e is None or e is U or isinstance(e, str):
            out.append(e)
        else:
            e = tuple(e)
            out.append(None if not e else e[0] if len(e) == 1 else e)
    return tuple(out)


# ---------------------------------------------------------------------------
# The module docstring's worked examples, exactly.
# ---------------------------------------------------------------------------


class TestWorkedExamples:
    def test_batch_stacks_then_embed_replicated(self):
        got = resolve(("batch", "embed"), DOC_RULES, DOC_MESH, (16, 8))
        assert got == P(("data", "fsdp"), None)
        assert tuple(got) == (("data", "fsdp"), None)

    def test_embed_mlp(self):
        assert resolve(("embed", "mlp"), DOC_RULES, DOC_MESH, (8, 6)) == P("fsdp", "model")

    def test_indivisible_first_rule_falls_back(self):
        assert resolve(("batch", None), DOC_RULES, DOC_MESH, (6, 3)) == P("fsdp", None)

    @pytest.mark.parametrize("shape", [None, (4,), (12,)])
    def test_tuple_dim(self, shape):
        rules = [("heads", "model"), ("kv", "fsdp")]
        assert resolve((("heads", "kv"),), rules, DOC_MESH, shape) == P(("model", "fsdp"))

    def test_tuple_dim_indivisible_product(self):
        # size 2: heads takes model (2 | 2); kv would need 2*2 = 4 -> skipped.
        rules = [("heads", "model"), ("kv", "fsdp")]
        assert resolve((("heads", "kv"),), rules, DOC_MESH, (2,)) == P("model")

    def test_rules_method_equals_function(self):
        r = Rules(DOC_RULES)
        for spec, shape in [(("batch", "embed"), (16, 8)), (("embed", "mlp"), (8, 6)), (("batch", None), (6, 3))]:
            assert r.resolve(spec, DOC_MESH, shape) == resolve(spec, DOC_RULES, DOC_MESH, shape)


# ---------------------------------------------------------------------------
# Semantics.
# ---------------------------------------------------------------------------


class TestPriority:
    def test_rule_order_not_dim_order(self):
        mesh = {"fsdp": 2}
        # embed's rule comes first, so embed gets fsdp although batch is dim 0.
        assert resolve(("batch", "embed"), [("embed", "fsdp"), ("batch", "fsdp")], mesh) == P(None, "fsdp")
        assert resolve(("batch", "embed"), [("batch", "fsdp"), ("embed", "fsdp")], mesh) == P("fsdp", None)
        # Same answer whichever dimension the names sit on.
        assert resolve(("embed", "batch"), [("embed", "fsdp"), ("batch", "fsdp")], mesh) == P("fsdp", None)

    def test_linen_docstring_example_with_stacking(self):
        # Flax's own example; we differ only by stacking Z on batch.
        spec = ("batch", "length", "heads", "features")
        rules = [("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z")]
        mesh = {"X": 2, "Y": 2, "Z": 2}
        assert nn.logical_to_mesh_axes(spec, rules) == P("X", None, "Y", None)
        assert resolve(spec, rules, mesh) == P(("X", "Z"), None, "Y", None)

    def test_priority_with_divisibility(self):
        # embed has priority on fsdp but fsdp does not divide it: batch gets fsdp.
        mesh = {"fsdp": 2}
        rules = [("embed", "fsdp"), ("batch", "fsdp")]
        assert resolve(("batch", "embed"), rules, mesh, (4, 3)) == P("fsdp", None)
        assert resolve(("batch", "embed"), rules, mesh, (4, 4)) == P(None, "fsdp")


class TestFallbackAndStacking:
    MESH: ClassVar = {"data": 4, "fsdp": 2, "model": 2}
    RULES: ClassVar = [("batch", "data"), ("batch", "fsdp")]

    def test_fallback_when_axis_taken(self):
        rules = [("embed", "data"), ("batch", "data"), ("batch", "fsdp")]
        assert resolve(("batch", "embed"), rules, self.MESH) == P("fsdp", "data")

    def test_fallback_when_not_divisible(self):
        assert resolve(("batch",), self.RULES, self.MESH, (2,)) == P("fsdp")
        assert resolve(("batch",), self.RULES, self.MESH, (6,)) == P("fsdp")

    def test_no_rule_applies(self):
        assert resolve(("batch",), self.RULES, self.MESH, (3,)) == P(None)

    def test_stacking_when_both_free_and_divisible(self):
        assert resolve(("batch",), self.RULES, self.MESH) == P(("data", "fsdp"))
        assert resolve(("batch",), self.RULES, self.MESH, (8,)) == P(("data", "fsdp"))
        assert resolve(("batch",), self.RULES, self.MESH, (24,)) == P(("data", "fsdp"))

    def test_stacked_product_must_divide(self):
        # 4 | 4 but 4*2 does not divide 4: only data.
        assert resolve(("batch",), self.RULES, self.MESH, (4,)) == P("data")
        assert resolve(("batch",), self.RULES, self.MESH, (12,)) == P("data")

    def test_stacking_order_follows_rules(self):
        rules = [("batch", "fsdp"), ("batch", "data")]
        assert resolve(("batch",), rules, self.MESH, (8,)) == P(("fsdp", "data"))

    def test_three_way_stack_with_gap(self):
        rules = [("batch", "data"), ("batch", "fsdp"), ("batch", "model")]
        assert resolve(("batch",), rules, self.MESH, (16,)) == P(("data", "fsdp", "model"))
        # 8: data, fsdp (8 | 8), then model would need 16 -> skipped.
        assert resolve(("batch",), rules, self.MESH, (8,)) == P(("data", "fsdp"))
        # 2: data skipped, fsdp, then model would need 4 -> skipped.
        assert resolve(("batch",), rules, self.MESH, (2,)) == P("fsdp")

    def test_stacking_skips_taken_axis(self):
        rules = [("embed", "fsdp"), ("batch", "data"), ("batch", "fsdp"), ("batch", "model")]
        assert resolve(("batch", "embed"), rules, self.MESH, (16, 4)) == P(("data", "model"), "fsdp")

    def test_later_dims_see_stacked_axes_as_used(self):
        rules = [("batch", "data"), ("batch", "fsdp"), ("embed", "fsdp"), ("embed", "model")]
        assert resolve(("batch", "embed"), rules, self.MESH, (8, 8)) == P(("data", "fsdp"), "model")
        # batch cannot stack (4 not divisible by 8): fsdp stays free for embed.
        assert resolve(("batch", "embed"), rules, self.MESH, (4, 8)) == P("data", ("fsdp", "model"))


class TestClosing:
    MESH: ClassVar = {"data": 4, "fsdp": 2}

    def test_none_rule_first_replicates(self):
        assert resolve(("batch",), [("batch", None), ("batch", "data")], self.MESH) == P(None)

    def test_none_rule_stops_stacking(self):
        rules = [("batch", "data"), ("batch", None), ("batch", "fsdp")]
        assert resolve(("batch",), rules, self.MESH, (8,)) == P("data")
        assert resolve(("batch",), rules, self.MESH) == P("data")

    def test_none_rule_stops_fallback(self):
        rules = [("batch", "data"), ("batch", None), ("batch", "fsdp")]
        # data does not divide 2; fsdp would, but batch was closed in between.
        assert resolve(("batch",), rules, self.MESH, (2,)) == P(None)

    def test_none_rule_for_other_name_does_not_close(self):
        rules = [("embed", None), ("batch", "data")]
        assert resolve(("batch", "embed"), rules, self.MESH) == P("data", None)

    def test_none_rule_does_not_use_an_axis(self):
        rules = [("embed", None), ("batch", "data")]
        assert resolve(("embed", "batch"), rules, self.MESH) == P(None, "data")

    def test_none_rule_in_tuple_dim_closes_only_that_name(self):
        # The implementation closes (dim, name), so the other name of a merged
        # dimension can still be sharded. (The docstring's step 1 says "if d
        # has been closed", which reads as the whole dimension.)
        rules = [("heads", None), ("kv", "fsdp"), ("heads", "data")]
        assert resolve((("heads", "kv"),), rules, self.MESH, (8,)) == P("fsdp")


class TestAxesAndDims:
    MESH: ClassVar = {"x": 2, "y": 4, "z": 2}

    def test_tuple_mesh_axes_in_one_rule(self):
        assert resolve(("a",), [("a", ("x", "y"))], self.MESH) == P(("x", "y"))
        assert resolve(("a",), [("a", ["y", "x"])], self.MESH) == P(("y", "x"))
        assert resolve(("a",), [("a", ("x",))], self.MESH) == P("x")

    def test_tuple_rule_divisibility_is_all_or_nothing(self):
        rules = [("a", ("x", "y")), ("a", "z")]
        assert resolve(("a",), rules, self.MESH, (8,)) == P(("x", "y"))
        # 8 does not divide 4 -> the whole tuple rule is skipped, z is the fallback.
        assert resolve(("a",), rules, self.MESH, (4,)) == P("z")

    def test_tuple_rule_skipped_if_any_axis_taken(self):
        rules = [("b", "x"), ("a", ("x", "y")), ("a", "y")]
        assert resolve(("a", "b"), rules, self.MESH) == P("y", "x")

    def test_tuple_of_logical_names_on_one_dim(self):
        rules = [("heads", "x"), ("kv", ("y", "z"))]
        assert resolve((("heads", "kv"), None), rules, self.MESH) == P(("x", "y", "z"), None)
        # Axes are appended in rule order, not name order within the dim.
        rules2 = [("kv", "y"), ("heads", "x")]
        assert resolve((("heads", "kv"),), rules2, self.MESH) == P(("y", "x"))

    def test_tuple_dim_names_one_of_its_names_unruled(self):
        assert resolve((("heads", "other"),), [("heads", "x")], self.MESH) == P("x")

    def test_tuple_dim_divisibility_uses_product(self):
        rules = [("heads", "x"), ("kv", "y")]
        assert resolve((("heads", "kv"),), rules, self.MESH, (16,)) == P(("x", "y"))
        assert resolve((("heads", "kv"),), rules, self.MESH, (4,)) == P("x")

    def test_mesh_axis_used_once_per_array(self):
        rules = [("a", "x"), ("b", "x"), ("c", "x")]
        assert resolve(("a", "b", "c"), rules, self.MESH) == P("x", None, None)
        assert resolve(("c", "b"), rules, self.MESH) == P(None, "x")

    def test_same_axis_not_stacked_twice_on_one_dim(self):
        rules = [("a", "x"), ("a", "x"), ("a", "y")]
        assert resolve(("a",), rules, self.MESH) == P(("x", "y"))

    def test_unconstrained_passes_through(self):
        rules = [("a", "x")]
        assert resolve((U, "a"), rules, self.MESH) == P(U, "x")
        assert resolve((U, None, U), rules, self.MESH, (3, 3, 3)) == P(U, None, U)
        assert next(iter(resolve((U,), rules, self.MESH))) is U

    def test_none_dims(self):
        assert resolve((None, "a", None), [("a", "x")], self.MESH, (3, 4, 5)) == P(None, "x", None)
        assert resolve((None, None), [("a", "x")], self.MESH) == P(None, None)

    def test_spec_shorter_than_rank(self):
        assert resolve(("a",), [("a", "x")], self.MESH, (4, 3, 5)) == P("x")
        assert resolve((), [("a", "x")], self.MESH, (4, 3)) == P()

    def test_spec_none_is_replicated(self):
        assert resolve(None, [("a", "x")], self.MESH, (4, 3)) == P()

    def test_spec_may_be_a_partition_spec(self):
        rules = [("a", "x"), ("b", "y")]
        assert resolve(P("a", None, ("b",)), rules, self.MESH) == P("x", None, "y")

    def test_unknown_name_replicated_when_not_strict(self):
        assert resolve(("a", "nope"), [("a", "x")], self.MESH, (2, 2)) == P("x", None)

    def test_no_shape_means_no_divisibility_check(self):
        assert resolve(("a",), [("a", "y")], self.MESH) == P("y")
        assert resolve(("a",), [("a", "y")], self.MESH, (3,)) == P(None)

    def test_size_one_axes_always_divide(self):
        assert resolve(("a",), [("a", "one")], {"one": 1}, (7,)) == P("one")

    def test_zero_size_dim_divides(self):
        assert resolve(("a",), [("a", "y")], self.MESH, (0,)) == P("y")

    def test_rule_for_name_not_in_spec_is_ignored(self):
        assert resolve(("a",), [("zz", "x"), ("a", "x")], self.MESH) == P("x")

    def test_empty_rules(self):
        assert resolve(("a", None), [], self.MESH, (2, 2)) == P(None, None)


# ---------------------------------------------------------------------------
# Strict mode.
# ---------------------------------------------------------------------------


class TestStrict:
    def test_indivisible_names_path_dim_size_axis(self):
        rules = Rules([("batch", "data"), ("embed", "fsdp")], strict=True)
        with pytest.raises(RuleError) as ei:
            resolve(("batch", "embed"), rules, DOC_MESH, (8, 3), path="params/dense/kernel")
        msg = str(ei.value)
        assert "params/dense/kernel" in msg
        assert "dimension 1" in msg
        assert "size 3" in msg
        assert "'fsdp'" in msg
        assert "'embed'" in msg

    def test_indivisible_raises_even_with_a_fallback(self):
        rules = Rules([("batch", "data"), ("batch", "fsdp")], strict=True)
        with pytest.raises(RuleError, match=r"dimension 0.*size 6.*'data'"):
            resolve(("batch",), rules, DOC_MESH, (6,), path="x")

    def test_indivisible_stacked_product_raises(self):
        rules = Rules([("batch", "data"), ("batch", "fsdp")], strict=True)
        with pytest.raises(RuleError, match=r"size 4.*'fsdp'"):
            resolve(("batch",), rules, DOC_MESH, (4,))

    def test_strict_ok_when_divisible(self):
        rules = Rules(DOC_RULES + [("vocab", None)], strict=True)
        assert resolve(("batch", "embed"), rules, DOC_MESH, (16, 8)) == P(("data", "fsdp"), None)

    def test_taken_axis_is_not_an_error(self):
        rules = Rules([("a", "fsdp"), ("b", "fsdp")], strict=True)
        assert resolve(("a", "b"), rules, DOC_MESH, (2, 3)) == P("fsdp", None)

    def test_closed_dim_is_not_checked(self):
        rules = Rules([("a", None), ("a", "data")], strict=True)
        assert resolve(("a",), rules, DOC_MESH, (3,)) == P(None)

    def test_unknown_logical_name_raises(self):
        rules = Rules([("batch", "data")], strict=True)
        with pytest.raises(RuleError, match=r"'mystery'.*no rule") as ei:
            resolve(("batch", "mystery"), rules, DOC_MESH, (8, 3), path="act")
        assert "act" in str(ei.value)

    def test_unknown_name_in_tuple_dim_raises(self):
        rules = Rules([("heads", "model")], strict=True)
        with pytest.raises(RuleError, match="'kv'"):
            resolve((("heads", "kv"),), rules, DOC_MESH)

    def test_none_rule_makes_name_known(self):
        rules = Rules([("batch", "data"), ("mystery", None)], strict=True)
        assert resolve(("batch", "mystery"), rules, DOC_MESH, (8, 3)) == P("data", None)

    def test_strict_without_shape_checks_names_only(self):
        rules = Rules([("batch", "data")], strict=True)
        assert resolve(("batch",), rules, DOC_MESH) == P("data")
        with pytest.raises(RuleError):
            resolve(("nope",), rules, DOC_MESH)

    def test_strict_override_in_resolve(self):
        loose = Rules([("batch", "data")])
        strict = Rules([("batch", "data")], strict=True)
        with pytest.raises(RuleError):
            resolve(("batch",), loose, DOC_MESH, (6,), strict=True)
        assert resolve(("batch",), strict, DOC_MESH, (6,), strict=False) == P(None)
        assert resolve(("nope",), strict, DOC_MESH, strict=False) == P(None)
        with pytest.raises(RuleError):
            resolve(("nope",), [("batch", "data")], DOC_MESH, strict=True)

    def test_none_dims_and_unconstrained_are_fine(self):
        rules = Rules([], strict=True)
        assert resolve((None, U), rules, DOC_MESH, (3, 3)) == P(None, U)


# ---------------------------------------------------------------------------
# Errors in every mode.
# ---------------------------------------------------------------------------


class TestDropped:
    """`resolution` reports the mesh axes that divisibility kept off each dimension."""

    def test_nothing_dropped(self):
        res = resolution(("batch", "embed"), DOC_RULES, DOC_MESH, (16, 8))
        assert res.spec == P(("data", "fsdp"), None) and res.dropped == ()
        assert resolution(("batch",), DOC_RULES, DOC_MESH).dropped == ()  # no shape, no divisibility
        assert resolution(None, DOC_RULES, DOC_MESH, (3,)) == Resolution(P())

    def test_fallback_reports_the_skipped_rule(self):
        # 4 does not divide 6: data is dropped, fsdp (the fallback) applies.
        res = resolution(("batch", None), DOC_RULES, DOC_MESH, (6, 3))
        assert res.spec == P("fsdp", None)
        assert res.dropped == (Dropped(0, ("data",), ("data", "fsdp")),)

    def test_stacked_product(self):
        # 4 | 12 but 4*2 does not: fsdp dropped, the dimension wanted (data, fsdp).
        res = resolution(("batch",), [("batch", "data"), ("batch", "fsdp")], DOC_MESH, (12,))
        assert res.dropped == (Dropped(0, ("fsdp",), ("data", "fsdp")),)
        res = resolution(("batch",), [("batch", "fsdp"), ("batch", "data")], DOC_MESH, (6,))
        assert res.dropped == (Dropped(0, ("data",), ("fsdp", "data")),)  # rule order

    def test_one_entry_per_dimension_in_dimension_order(self):
        rules = [("mlp", "model"), ("embed", "data"), ("embed", "fsdp")]
        res = resolution(("embed", "mlp"), rules, DOC_MESH, (2, 3))
        assert res.spec == P("fsdp", None)
        assert res.dropped == (Dropped(0, ("data",), ("data", "fsdp")), Dropped(1, ("model",), ("model",)))

    def test_axis_taken_elsewhere_is_not_dropped(self):
        res = resolution(("a", "b"), [("a", "x"), ("b", "x")], {"x": 2}, (4, 4))
        assert res.spec == P("x", None) and res.dropped == ()

    def test_tuple_rule_and_duplicates(self):
        rules = [("batch", ("data", "fsdp")), ("batch", "data")]
        res = resolution(("batch",), rules, DOC_MESH, (4,))
        assert res.spec == P("data")
        assert res.dropped == (Dropped(0, ("fsdp",), ("data", "fsdp")),)

    def test_spec_and_method_agree_with_resolve(self):
        r = Rules(DOC_RULES)
        for spec, shape in [(("batch", "embed"), (16, 8)), (("batch", None), (6, 3)), (("mlp",), (3,))]:
            assert r.resolution(spec, DOC_MESH, shape) == resolution(spec, DOC_RULES, DOC_MESH, shape)
            assert r.resolution(spec, DOC_MESH, shape).spec == resolve(spec, DOC_RULES, DOC_MESH, shape)

    def test_strict_raises_instead(self):
        with pytest.raises(RuleError, match="not divisible"):
            resolution(("batch",), DOC_RULES, DOC_MESH, (6,), strict=True)


class TestErrors:
    @pytest.mark.parametrize("strict", [False, True])
    def test_unknown_mesh_axis_in_rule(self, strict):
        rules = Rules([("batch", "data"), ("mlp", "tensor")], strict=strict)
        if not strict:  # unused: no error (strict: any rule the mesh cannot apply)
            assert resolve(("batch",), rules, DOC_MESH, (8,)) == P("data")
        with pytest.raises(RuleError, match=r"'tensor'") as ei:
            resolve(("batch",) if strict else ("mlp",), rules, DOC_MESH, (8,))
        msg = str(ei.value)
        for axis in DOC_MESH:
            assert axis in msg  # the mesh's axes are listed

    def test_unknown_mesh_axis_in_an_unused_rule_is_no_error(self):
        """MultiMesh accepts a rule for an axis the mesh lacks while no array names its logical name; an
        array that does is refused, naming the rule and the array."""
        assert resolve(None, [("zz", "nope")], DOC_MESH) == P()
        assert resolve(("a",), [("a", "data"), ("zz", ("fsdp", "nope"))], DOC_MESH) == P("data")
        with pytest.raises(RuleError, match=r"rule \('zz', \('fsdp', 'nope'\)\) names mesh axis 'nope'.*"
                                            r"array of 'w' \(spec \('zz',\)\) names 'zz'"):
            resolve(("zz",), [("a", "data"), ("zz", ("fsdp", "nope"))], DOC_MESH, path="w")

    def test_check_mesh_directly(self):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Rules(DOC_RULES).check_mesh(DOC_MESH)
        with pytest.warns(RuleWarning, match=r"'model'.*'data'"):
            Rules(DOC_RULES).check_mesh({"data": 2, "fsdp": 2})
        with pytest.raises(RuleError, match=r"'model'.*'data'"):
            Rules(DOC_RULES).require_mesh({"data": 2, "fsdp": 2})

    def test_spec_longer_than_rank(self):
        with pytest.raises(RuleError) as ei:
            resolve(("batch", "embed", None), DOC_RULES, DOC_MESH, (8, 8), path="w/kernel")
        msg = str(ei.value)
        assert "w/kernel" in msg
        assert "rank 3" in msg and "rank 2" in msg

    def test_spec_longer_than_scalar(self):
        with pytest.raises(RuleError, match="rank 0"):
            resolve(("batch",), DOC_RULES, DOC_MESH, ())

    def test_logical_name_on_two_dims(self):
        with pytest.raises(RuleError, match=r"'embed'.*dimensions 0 and 1"):
            resolve(("embed", "embed"), DOC_RULES, DOC_MESH, path="w")
        with pytest.raises(RuleError, match=r"'embed'.*dimensions 0 and 2"):
            resolve(("embed", None, ("mlp", "embed")), DOC_RULES, DOC_MESH)

    def test_logical_name_twice_in_one_tuple_dim(self):
        with pytest.raises(RuleError, match="'kv'"):
            resolve((("kv", "kv"),), [], DOC_MESH)

    def test_logical_name_twice_even_without_rules(self):
        with pytest.raises(RuleError, match="'q'"):
            resolve(("q", "q"), [], DOC_MESH)

    def test_non_str_name_in_tuple_dim(self):
        with pytest.raises(RuleError, match="non-str"):
            resolve((("heads", 3),), [], DOC_MESH)

    @pytest.mark.parametrize(
        "bad",
        [
            [("batch", "data", "x")],  # not a pair
            [("batch",)],
            ["ab"],  # a 2-character string is not a pair
            ["batch"],
            [None],
            [(1, "data")],  # non-str name
            [(None, "data")],
            [(("batch",), "data")],
            [("batch", ("data", 3))],  # non-str axis inside a tuple
            [("batch", [None])],
        ],
    )
    def test_malformed_rules(self, bad):
        with pytest.raises(RuleError, match=r"rule #0"):
            Rules(bad)
        with pytest.raises(RuleError):
            resolve(("batch",), bad, DOC_MESH)

    def test_malformed_rule_index_in_message(self):
        with pytest.raises(RuleError, match=r"rule #2"):
            Rules([("a", "x"), ("b", None), ("c", "d", "e")])

    def test_single_pair_instead_of_list(self):
        with pytest.raises(RuleError):
            Rules(("batch", "data"))

    def test_rule_error_is_value_error(self):
        assert issubclass(RuleError, ValueError)


class TestCheckPhysical:
    MESH: ClassVar = {"x": 2, "y": 4}

    def test_valid_specs_returned_as_is(self):
        spec = P("x", None, ("y",))
        assert check_physical(spec, self.MESH, (2, 3, 4)) is spec
        assert check_physical(P(("x", "y")), self.MESH, (8,)) == P(("x", "y"))
        assert check_physical(P(U, "x"), self.MESH, (3, 2)) == P(U, "x")
        assert check_physical(P(), self.MESH, ()) == P()
        assert check_physical(P("y"), self.MESH, None) == P("y")

    @pytest.mark.parametrize(
        "spec",
        [P("x", "x"), P(("x", "y"), "x"), P(("x", "x")), P("y", None, ("x", "y"))],
    )
    def test_axis_used_twice(self, spec):
        with pytest.raises(RuleError, match=r"'(x|y)' twice") as ei:
            check_physical(spec, self.MESH, None, path="p/q")
        assert "p/q" in str(ei.value)

    def test_unknown_axis(self):
        with pytest.raises(RuleError, match=r"'z'.*'x'.*'y'"):
            check_physical(P("z"), self.MESH, None)

    def test_longer_than_rank(self):
        with pytest.raises(RuleError, match=r"rank 1.*w") as ei:
            check_physical(P("x", None), self.MESH, (4,), path="w")
        assert "(4,)" in str(ei.value)

    def test_not_divisible(self):
        with pytest.raises(RuleError, match=r"dimension 1 \(size 6\).*\('y',\)") as ei:
            check_physical(P(None, "y"), self.MESH, (3, 6), path="w")
        assert "w" in str(ei.value)
        with pytest.raises(RuleError, match="size 4"):
            check_physical(P(("x", "y")), self.MESH, (4,))


# ---------------------------------------------------------------------------
# The Rules container.
# ---------------------------------------------------------------------------


class TestRulesContainer:
    def test_normalisation_and_properties(self):
        r = Rules([["a", ["x", "y"]], ("b", None), ("c", "z")])
        assert r.rules == (("a", ("x", "y")), ("b", None), ("c", "z"))
        assert len(r) == 3
        assert list(r) == list(r.rules)
        assert r.logical_names == frozenset("abc")
        assert r.mesh_axes == frozenset("xyz")
        assert not r.strict

    def test_copy_and_strict_propagation(self):
        r = Rules([("a", "x")], strict=True)
        assert Rules(r).strict and Rules(r).rules == r.rules
        assert Rules(r, strict=False).strict  # strict is sticky
        assert Rules(Rules([("a", "x")]), strict=True).strict

    def test_add(self):
        r = Rules([("a", "x")], strict=True) + [("b", "y")]
        assert r.rules == (("a", "x"), ("b", "y"))
        assert r.strict
        with pytest.raises(RuleError):
            Rules([("a", "x")]) + [("b",)]

    def test_repr(self):
        assert "strict=True" in repr(Rules([("a", "x")], strict=True))
        assert "'a'->'x'" in repr(Rules([("a", "x")]))

    def test_identity_rules(self):
        r = identity_rules(["data", "model"])
        assert r.rules == (("data", "data"), ("model", "model"))
        assert resolve(("model", "data"), r, {"data": 2, "model": 2}) == P("model", "data")


# ---------------------------------------------------------------------------
# PathRules.
# ---------------------------------------------------------------------------


class TestPathRules:
    def test_first_match_wins(self):
        pr = PathRules([(r"kernel", ("embed", "mlp")), (r"dense/kernel", P("x", None)), (r".*", ())])
        assert pr.match("layer/dense/kernel") == ("embed", "mlp")
        assert pr.match("layer/dense/bias") == ()
        pr2 = PathRules([(r"dense/kernel", P("x", None)), (r"kernel", ("embed", "mlp"))])
        assert pr2.match("layer/dense/kernel") == P("x", None)
        assert pr2.match("conv/kernel") == ("embed", "mlp")

    def test_search_semantics(self):
        pr = PathRules([(r"attn/(q|k|v)", ("embed", "heads")), (r"^head$", ("embed", "vocab"))])
        assert pr.match("blocks_0/attn/q/kernel") == ("embed", "heads")  # not anchored
        assert pr.match("blocks_0/attn/o/kernel") is None
        assert pr.match("head") == ("embed", "vocab")
        assert pr.match("lm/head") is None  # explicit anchors respected
        assert pr.match("head/kernel") is None

    def test_no_match_and_empty(self):
        assert PathRules().match("anything") is None
        assert len(PathRules()) == 0
        assert PathRules({"a": ("x",)}).match("b") is None

    def test_mapping_form_keeps_order(self):
        pr = PathRules({"bias": (None,), "dense": ("embed", "mlp")})
        assert len(pr) == 2
        assert pr.match("dense/bias") == (None,)
        assert pr.match("dense/kernel") == ("embed", "mlp")

    def test_list_form_and_compiled_patterns(self):
        pr = PathRules([(re.compile(r"EMB", re.IGNORECASE), ("vocab", "embed"))])
        assert pr.match("tok/emb/embedding") == ("vocab", "embed")
        assert PathRules(pr).match("emb") == ("vocab", "embed")
        assert PathRules(pr).patterns == pr.patterns

    def test_invalid_regex(self):
        with pytest.raises(RuleError, match=r"'dense\[' is not a valid regular expression"):
            PathRules({"dense[": ("embed",)})
        with pytest.raises(RuleError, match=r"'\(\?P<'"):
            PathRules([("ok", ()), ("(?P<", ())])

    def test_repr(self):
        assert "'kernel'" in repr(PathRules({"kernel": ("embed",)}))

    def test_logical_vs_physical_values(self):
        """A tuple value is logical (goes through the rules); a PartitionSpec is
        physical (validated, used as is)."""
        rules = Rules([("embed", "fsdp"), ("mlp", "model")])
        pr = PathRules([("mlp/wi", ("embed", "mlp")), ("mlp/wo", P("model", "fsdp")), ("bad", P("mlp", None))])
        logical = pr.match("blocks/mlp/wi/kernel")
        physical = pr.match("blocks/mlp/wo/kernel")
        assert not isinstance(logical, P) and isinstance(physical, P)
        assert resolve(logical, rules, DOC_MESH, (8, 6)) == P("fsdp", "model")
        assert check_physical(physical, DOC_MESH, (6, 8)) == P("model", "fsdp")
        # A PartitionSpec is not translated: a logical name in it is an unknown mesh axis.
        with pytest.raises(RuleError, match="'mlp'"):
            check_physical(pr.match("bad"), DOC_MESH, (6, 8))


# ---------------------------------------------------------------------------
# standard_rules.
# ---------------------------------------------------------------------------


class TestStandardRules:
    ALL: ClassVar = ["data", "fsdp", "tensor", "model", "stage", "pipe", "expert"]

    @pytest.mark.parametrize("n", range(len(ALL) + 1))
    def test_only_names_axes_the_mesh_has(self, n):
        for axes in itertools.combinations(self.ALL, n):
            r = standard_rules(axes)
            assert r.mesh_axes <= set(axes), (axes, r)
            r.check_mesh({a: 2 for a in axes})  # never an unknown-axis error
            assert all(a is not None for _, a in r)

    def test_full_mesh(self):
        r = standard_rules(["data", "fsdp", "tensor", "stage"])
        assert ("batch", "data") in r.rules and ("batch", "fsdp") in r.rules
        assert r.rules.index(("batch", "data")) < r.rules.index(("batch", "fsdp"))
        for name in ("mlp", "heads", "kv_heads", "vocab"):
            assert (name, "tensor") in r.rules
        assert ("embed", "fsdp") in r.rules and ("layers", "stage") in r.rules
        mesh = {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1}
        assert resolve(("batch", "length", "embed"), r, mesh, (8, 16, 32)) == P(("data", "fsdp"), None, None)
        assert resolve(("embed", "mlp"), r, mesh, (32, 64)) == P("fsdp", "tensor")
        assert resolve(("vocab", "embed"), r, mesh, (100, 32)) == P("tensor", "fsdp")

    def test_tensor_preferred_over_model(self):
        r = standard_rules(["model", "tensor"])
        assert r.mesh_axes == {"tensor"}
        assert standard_rules(["model"]).mesh_axes == {"model"}
        assert ("heads", "model") in standard_rules(["data", "model"]).rules

    def test_data_only(self):
        r = standard_rules(["data"])
        assert r.rules == (("batch", "data"),)
        assert resolve(("batch", "embed"), r, {"data": 8}, (16, 4)) == P("data", None)

    def test_no_known_axes(self):
        assert len(standard_rules(["foo", "bar"])) == 0
        assert len(standard_rules([])) == 0

    def test_strict_flag_and_accepts_iterables(self):
        assert standard_rules(["data"], strict=True).strict
        assert not standard_rules(iter(["data"])).strict
        assert standard_rules(x for x in ["fsdp"]).mesh_axes == {"fsdp"}


class TestSequenceRules:
    """``named_rules("sequence", ...)``: the standard rules, and activations' ``length`` over the tensor axis
    where nothing else of the array takes it (Megatron's sequence parallelism)."""

    MESH: ClassVar = {"data": 2, "fsdp": 2, "tensor": 2}

    def test_the_residual_stream_splits_its_sequence_and_the_megatron_dimensions_keep_the_tensor_axis(self):
        r = named_rules("sequence", tuple(self.MESH))
        assert r.rules[:-1] == standard_rules(tuple(self.MESH)).rules and r.rules[-1] == ("length", "tensor")
        shape = (8, 16, 32)
        assert resolve(("batch", "length", "embed"), r, self.MESH, shape) == P(("data", "fsdp"), "tensor", None)
        # heads, mlp and vocab come first: an array with both keeps its sequence whole
        assert resolve(("batch", "length", "heads", "kv"), r, self.MESH, (8, 16, 4, 8)) == \
            P(("data", "fsdp"), None, "tensor", None)
        assert resolve(("batch", "length", "mlp"), r, self.MESH, (8, 16, 64)) == P(("data", "fsdp"), None, "tensor")
        assert resolve(("embed", "mlp"), r, self.MESH, (32, 64)) == P("fsdp", "tensor")  # parameters as standard
        assert ("length", "model") in named_rules("sequence", ("data", "model")).rules

    def test_without_a_tensor_axis_they_are_the_standard_rules(self):
        assert named_rules("sequence", ("data", "fsdp")).rules == standard_rules(("data", "fsdp")).rules
        assert named_rules("standard", tuple(self.MESH)).rules == standard_rules(tuple(self.MESH)).rules

    def test_an_unknown_name_lists_the_rule_sets(self):
        assert RULE_SETS == ("standard", "sequence")
        with pytest.raises(ValueError, match=r"'sequential' is not one of \['standard', 'sequence'\]"):
            named_rules("sequential", ("data",))


# ---------------------------------------------------------------------------
# Bugs found while writing these tests.
# ---------------------------------------------------------------------------


def test_regression_non_iterable_mesh_axes_in_rule_is_rule_error():
    """BUG: `Rules([("batch", 3)])` raises a bare TypeError ("'int' object is not
    iterable") from `tuple(axes)` instead of a RuleError naming the rule.
    Fix: in `Rules.__init__`, accept only str, None, or a tuple/list of str,
    and raise RuleError(f"rule #{i} {rule!r}: mesh axes must be ...") otherwise."""
    with pytest.raises(RuleError, match=r"rule #0"):
        Rules([("batch", 3)])


def test_regression_non_str_non_tuple_spec_entry_is_rule_error():
    """BUG: a spec entry that is neither str, None, UNCONSTRAINED nor a tuple
    (e.g. an int) raises a bare TypeError from `tuple(entry)` instead of the
    RuleError ("dimension 0 has non-str name 3") that the code intends.
    Fix: `names = (entry,) if not isinstance(entry, (tuple, list)) else tuple(entry)`,
    so the existing non-str check reports it."""
    with pytest.raises(RuleError, match="non-str"):
        resolve((3,), [], DOC_MESH)


def test_regression_duplicate_axis_within_one_rule():
    """BUG: a rule naming the same mesh axis twice, ("a", ("x", "x")), yields
    P(("x", "x")): a mesh axis used twice in one array, which JAX rejects later
    with a less helpful error (and divisibility is checked against 2*2).
    Fix: reject it in `Rules.__init__` (RuleError naming the rule and the axis),
    or drop repeated axes when normalising the rule."""
    try:
        got = resolve(("a",), [("a", ("x", "x"))], {"x": 2}, (4,))
    except RuleError as e:
        assert "'x'" in str(e)
    else:
        check_physical(got, {"x": 2}, (4,))  # must not use "x" twice


def test_regression_empty_tuple_rule_behaves_like_linen():
    """BUG (Linen divergence): a rule ("a", ()) assigns no axis and does *not*
    close the name, so a later ("a", "x") applies: P("x"). Linen treats () like
    None (it fills the dimension, closing it) and gives P(None); there is no
    stacking or divisibility decision here, so API.md requires equality.
    Fix: normalise an empty tuple/list of mesh axes to None in `Rules.__init__`
    (or reject it)."""
    rules = [("a", ()), ("a", "x")]
    ours = resolve(("a",), rules, {"x": 2})
    assert norm(ours, 1) == norm(nn.logical_to_mesh_axes(("a",), rules), 1)


# ---------------------------------------------------------------------------
# Property tests.
# ---------------------------------------------------------------------------

NAMES = ("a", "b", "c", "d", "e")
AXES = ("x", "y", "z")
PROP = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def mesh_sizes(draw):
    return {a: draw(st.sampled_from([1, 2, 3, 4])) for a in AXES}


# Mesh axes of a rule: None, one axis, or a tuple of distinct axes. (Empty
# tuples and repeated axes are left out: see the test_BUG_* tests above.)
rule_axes = st.one_of(
    st.none(),
    st.sampled_from(AXES),
    st.lists(st.sampled_from(AXES), min_size=1, max_size=3, unique=True).map(tuple),
)
rule = st.tuples(st.sampled_from(NAMES), rule_axes)


@st.composite
def rule_lists(draw, max_size: int = 12):
    """Rules with a uniformly drawn length (plain `st.lists` favours very short
    lists, which would make fallbacks and stacking rare)."""
    n = draw(st.integers(0, max_size))
    return draw(st.lists(rule, min_size=n, max_size=n))


@st.composite
def flat_spec(draw):
    """Distinct logical names, None and UNCONSTRAINED dims (Linen-compatible)."""
    n = draw(st.integers(0, 4))
    names = draw(st.lists(st.sampled_from(NAMES), min_size=n, max_size=n, unique=True))
    out = []
    for name in names:
        out.append(draw(st.sampled_from([name, name, name, None, U])))
    return tuple(out)


@st.composite
def general_spec(draw):
    """Like flat_spec, but a dimension may also hold a tuple of names."""
    n = draw(st.integers(1, 4))
    pool = list(draw(st.permutations(NAMES)))
    out = []
    for _ in range(n):
        kind = draw(st.sampled_from(["name", "name", "tuple", "none", "unc"]))
        if kind == "name" and pool:
            out.append(pool.pop())
        elif kind == "tuple" and pool:
            k = draw(st.integers(1, min(3, len(pool))))
            out.append(tuple(pool.pop() for _ in range(k)))
        elif kind == "unc":
            out.append(U)
        else:
            out.append(None)
    return tuple(out)


def reference(spec, rules, sizes, shape, strict):
    """An independent re-statement of the documented algorithm.

    Returns (per-dim axes, per-dim indices of the rules that contributed), or
    the string "error" where the rules must raise.
    """
    where: dict[str, int] = {}
    for d, entry in enumerate(spec):
        if entry is None or entry is U:
            continue
        for name in (entry,) if isinstance(entry, str) else entry:
            where[name] = d
    if shape is not None and len(spec) > len(shape):
        return "error"
    if strict and any(name not in {n for n, _ in rules} for name in where):
        return "error"
    axes_of = {d: [] for d in range(len(spec))}
    fired = {d: [] for d in range(len(spec))}
    closed_names: set[str] = set()
    for i, (name, axes) in enumerate(rules):
        if name not in where or name in closed_names:
            continue
        d = where[name]
        if axes is None:
            closed_names.add(name)
            continue
        new = [axes] if isinstance(axes, str) else list(axes)
        taken = {a for lst in axes_of.values() for a in lst}
        if taken & set(new):
            continue
        if shape is not None:
            total = 1
            for a in axes_of[d] + new:
                total *= sizes[a]
            if shape[d] % total != 0:
                if strict:
                    return "error"
                continue
        axes_of[d] += new
        fired[d].append(i)
    return [axes_of[d] for d in range(len(spec))], [fired[d] for d in range(len(spec))]


def ours_as_list(spec, rules, sizes, shape=None, strict=False):
    return norm(resolve(spec, Rules(rules, strict=strict), sizes, shape), len(spec))


def ref_as_tuple(spec, axes_of):
    out = []
    for entry, axes in zip(spec, axes_of):
        out.append(U if entry is U else norm([tuple(axes)])[0])
    return tuple(out)


@PROP
@given(spec=flat_spec(), rules=st.lists(rule, max_size=8, unique_by=lambda r: r[0]), sizes=mesh_sizes())
def test_property_equals_linen_with_one_rule_per_name(spec, rules, sizes):
    """With at most one rule per logical name there is nothing to stack; with
    no shape there is no divisibility decision: Linen's answer is ours."""
    ours = resolve(spec, rules, sizes)
    linen = nn.logical_to_mesh_axes(spec, rules)
    assert len(ours) == len(spec)
    assert norm(ours, len(spec)) == norm(linen, len(spec))


@PROP
@given(spec=flat_spec(), rules=rule_lists(), sizes=mesh_sizes())
def test_property_equals_linen_without_stacking(spec, rules, sizes):
    """Names may repeat (fallbacks). Compare with Linen whenever no dimension
    received mesh axes from more than one rule (decided by the reference)."""
    ref = reference(spec, rules, sizes, None, False)
    assert ref != "error"
    axes_of, fired = ref
    ours = resolve(spec, rules, sizes)
    assert norm(ours, len(spec)) == ref_as_tuple(spec, axes_of)
    if all(len(f) <= 1 for f in fired):
        event("compared with Linen")
        assert norm(ours, len(spec)) == norm(nn.logical_to_mesh_axes(spec, rules), len(spec))
    else:
        # Stacking happened: Linen gives that dimension only the first rule's axes.
        linen = norm(nn.logical_to_mesh_axes(spec, rules), len(spec))
        for d, f in enumerate(fired):
            if len(f) > 1:
                first = rules[f[0]][1]
                assert linen[d] == norm([first])[0]


@st.composite
def spec_and_shape(draw):
    spec = draw(general_spec())
    extra = draw(st.integers(0, 2))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 48, 144, 144, 144])) for _ in range(len(spec) + extra))
    return spec, shape


@st.composite
def case_with_shape(draw):
    """A spec with a shape, and rules mostly about the spec's own names (so
    that fallbacks, stacking and divisibility skips are common)."""
    spec, shape = draw(spec_and_shape())
    used = sorted({n for e in spec if e is not None and e is not U for n in ((e,) if isinstance(e, str) else e)})
    pool = used + ["zz"] if used else list(NAMES)
    n = draw(st.integers(0, 12))
    axes = st.one_of(st.sampled_from(AXES), st.sampled_from(AXES), rule_axes)  # favour single axes
    rules = draw(st.lists(st.tuples(st.sampled_from(pool), axes), min_size=n, max_size=n))
    return spec, shape, rules


@PROP
@given(case=case_with_shape(), sizes=mesh_sizes(), strict=st.booleans())
def test_property_equals_reference_with_shapes(case, sizes, strict):
    """Tuple dims, fallbacks, stacking and divisibility: the library equals an
    independent statement of the documented algorithm, in both modes, and its
    output is always a valid physical spec for the array."""
    spec, shape, rules = case
    ref = reference(spec, rules, sizes, shape, strict)
    event(f"strict={strict}, outcome={'error' if ref == 'error' else 'resolved'}")
    if ref != "error":
        event("stacked" if any(len(f) > 1 for f in ref[1]) else "not stacked")
        event("divisibility skip" if ref_as_tuple(spec, ref[0]) != ref_as_tuple(spec, reference(spec, rules, sizes, None, False)[0]) else "no skip")
    if ref == "error":
        with pytest.raises(RuleError):
            resolve(spec, Rules(rules, strict=strict), sizes, shape)
        return
    got = resolve(spec, Rules(rules, strict=strict), sizes, shape)
    assert norm(got, len(spec)) == ref_as_tuple(spec, ref[0])
    check_physical(got, sizes, shape)  # no axis twice, known axes, divisible
    # The spec may equally be given as a PartitionSpec.
    assert resolve(P(*spec), Rules(rules, strict=strict), sizes, shape) == got
    if strict:  # strict mode only adds errors, never changes an answer
        assert resolve(spec, rules, sizes, shape) == got


@PROP
@given(ss=spec_and_shape(), rules=rule_lists(), sizes=mesh_sizes())
def test_property_no_shape_is_shape_of_multiples(ss, rules, sizes):
    """Without a shape, divisibility is not checked: the same as a shape whose
    dims are divisible by every product of mesh axes."""
    spec, _ = ss
    big = math.prod(sizes.values())
    assert resolve(spec, rules, sizes) == resolve(spec, rules, sizes, (big,) * len(spec))


# ---------------------------------------------------------------------------
# Placement.
# ---------------------------------------------------------------------------


def make_mesh(shape, names):
    devices = np.array(jax.devices()[: math.prod(shape)]).reshape(shape)
    return Mesh(devices, names)


@pytest.mark.devices(8)
class TestPlacement:
    def test_identity_fallback(self):
        mesh = make_mesh((4, 2), ("data", "model"))
        s = Placement(mesh, Rules([("batch", "data")]))
        assert s.spec(("batch", "model")) == P("data", "model")
        # Identity rules for "data" and "model" are appended after the user's.
        assert s.spec(("model", "data")) == P("model", "data")
        assert s.spec(("model",), (6, 5)) == P("model")

    def test_identity_fallback_order(self):
        mesh = make_mesh((4, 2), ("data", "model"))
        s = Placement(mesh, Rules([("batch", "data")]))
        assert s.spec(("data", "model")) == P("data", "model")
        # The user's rule comes first: batch takes data, the "data" name then finds it used.
        assert s.spec(("batch", "data")) == P("data", None)
        names = [n for n, _ in s.rules]
        assert names == ["batch", "data", "model"]

    def test_user_rule_for_mesh_axis_name_takes_priority(self):
        mesh = make_mesh((4, 2), ("data", "model"))
        s = Placement(mesh, Rules([("data", "model")]))
        assert s.spec(("data",)) == P("model")
        assert ("data", "data") not in s.rules.rules  # no identity rule for a user-named axis
        assert ("model", "model") in s.rules.rules
        assert s.spec(("data", "model")) == P("model", None)
        assert s.spec(("model", "data")) == P(None, "model")

    def test_user_none_rule_for_mesh_axis_name(self):
        mesh = make_mesh((8,), ("data",))
        s = Placement(mesh, Rules([("data", None)]))
        assert s.spec(("data",)) == P(None)

    def test_strict_scope_accepts_mesh_axis_names(self):
        mesh = make_mesh((2, 4), ("fsdp", "tensor"))
        s = Placement(mesh, Rules([("embed", "fsdp")], strict=True))
        assert s.rules.strict
        assert s.spec(("embed", "tensor"), (4, 8)) == P("fsdp", "tensor")
        with pytest.raises(RuleError, match="'mlp'"):
            s.spec(("embed", "mlp"), (4, 8))
        with pytest.raises(RuleError, match=r"size 6.*'tensor'"):
            s.spec(("embed", "tensor"), (4, 6), path="w")

    def test_divisibility_and_sharding(self):
        mesh = make_mesh((4, 2), ("data", "model"))
        s = Placement(mesh, [("batch", "data"), ("batch", "model")])
        assert s.spec(("batch",), (8, 3)) == P(("data", "model"))
        assert s.spec(("batch",), (4, 3)) == P("data")
        sh = s.sharding(("batch", None), (8, 3))
        assert isinstance(sh, NamedSharding) and sh.mesh is mesh and sh.spec == P(("data", "model"), None)
        assert s.axis_sizes == {"data": 4, "model": 2}

    def test_unknown_axis_in_rule_warns(self):
        mesh = make_mesh((4, 2), ("data", "model"))
        with pytest.warns(RuleWarning, match=r"'tensor'.*'data'"):
            Placement(mesh, Rules([("mlp", "tensor")]))
        with pytest.warns(RuleWarning, match="'pipe'"):
            placement = Placement(mesh, [("layers", ("data", "pipe"))])
        with pytest.raises(RuleError, match="'pipe'.*'layers'"):
            placement.rules.resolve(("layers",), placement.axis_sizes, (8,))

    def test_physical(self):
        mesh = make_mesh((4, 2), ("data", "model"))
        s = Placement(mesh)
        assert s.physical(P("data", "model"), (8, 2)).spec == P("data", "model")
        with pytest.raises(RuleError, match="twice"):
            s.physical(P("data", "data"))
        with pytest.raises(RuleError, match="'batch'"):
            s.physical(P("batch"))
        with pytest.raises(RuleError, match="size 2"):
            s.physical(P("data"), (2,))

    def test_default_placement_is_identity(self):
        mesh = make_mesh((2, 2, 2), ("a", "b", "c"))
        s = Placement(mesh)
        assert s.rules.rules == (("a", "a"), ("b", "b"), ("c", "c"))
        assert s.spec(("c", None, "a")) == P("c", None, "a")
        assert s.spec(("zz",)) == P(None)

    def test_use_placement(self):
        mesh = make_mesh((8,), ("data",))
        s = Placement(mesh, name="t")
        assert current_placement() is None
        with use_placement(s) as got:
            assert got is s and current_placement() is s
            with use_placement(None):
                assert current_placement() is None
            assert current_placement() is s
        assert current_placement() is None
        assert repr(s).startswith("Placement(t on {'data': 8} devices [0-7], rules=")
