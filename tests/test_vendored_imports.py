"""A vendored model that does not import on the installed JAX is a skip with the reason, never a collection error;
a kernel it imports but the tests never run is stood in (`vendored`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from vendored import import_or_skip, stand_ins

pytest_plugins = ["pytester"]

GONE = "jax.experimental.no_such_kernel_module"


def test_a_model_failing_to_import_at_module_level_skips_its_file(pytester):
    pytester.syspathinsert(Path(__file__).resolve().parent)
    pytester.makepyfile(test_model="""
        import importlib
        from vendored import import_or_skip
        model = import_or_skip("tests/thirdparty/gone", lambda: importlib.import_module("jax.no_such_module"))

        def test_it():
            assert False, "never runs"
    """)
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*vendored tests/thirdparty/gone does not import on jax *, flax *: "
                                 "ModuleNotFoundError: No module named 'jax.no_such_module'*"])


def test_a_removed_name_is_a_skip_and_other_errors_stay_errors():
    def removed():
        import jax
        return jax.no_such_function

    with pytest.raises(pytest.skip.Exception, match="vendored m does not import on jax .*AttributeError"):
        import_or_skip("m", removed)
    with pytest.raises(AttributeError):   # a page's cells: only an import failure is a skip
        import_or_skip("page.md", removed, errors=(ImportError,))
    with pytest.raises(ZeroDivisionError):
        import_or_skip("m", lambda: 1 / 0)


def test_a_stand_in_raises_when_called_and_is_gone_afterwards():
    with stand_ins({GONE: ("removed from JAX", ("kernel",)), "json": ("never stood in", ("loads",))}):
        from jax.experimental import no_such_kernel_module

        with pytest.raises(NotImplementedError, match=f"{GONE}.kernel is a stand-in: removed from JAX"):
            no_such_kernel_module.kernel(1)
        assert sys.modules["json"].loads("1") == 1   # a module that exists is not stood in
    assert GONE not in sys.modules
