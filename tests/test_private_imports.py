"""Dependencies' private internals are used only in `multimesh/_compat/`.

Private: a module, name or attribute of a dependency whose name starts with one underscore
(``jax._src``, ``from flax.linen.module import _context``, ``linen_spmd._with_sharding_...``,
``handler._metadata_key``; dunders such as ``__version__`` are public). Found from the source's AST:

1. imports of a private module or name of a dependency;
2. a private attribute of a name imported from a dependency (``NamedSharding._internal_device_list``);
3. a private attribute that multimesh never defines itself, of any object (``h._dispatcher`` where
   ``h`` is an Orbax handler): multimesh's own are assigned on ``self``/``cls``, defined or declared
   somewhere in the scanned packages;
4. in a class derived from a dependency's class, a private name of that class (read or written on
   ``self``, or a method overriding one): ``self._impl``, ``async def _save_fn``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import textwrap
import types
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("multimesh", "trainers", "models")
ALLOWED = ("multimesh", "_compat")  # the one folder allowed to use internals
DEPENDENCIES = frozenset({"jax", "jaxlib", "flax", "optax", "orbax", "tensorstore", "numpy", "ml_dtypes",
                          "yaml", "tqdm", "matplotlib", "chex", "etils", "absl"})
#: Public names of the standard library that start with one underscore (namedtuple's API, os._exit...).
STDLIB_PUBLIC = frozenset({"_asdict", "_replace", "_fields", "_make", "_field_defaults", "_exit", "_getframe"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources(root: pathlib.Path) -> dict[pathlib.Path, ast.Module]:
    files = sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))
    return {p: ast.parse(p.read_text(), str(p)) for p in files}


def _own_names(trees: dict[pathlib.Path, ast.Module]) -> set[str]:
    """Names the scanned code defines itself (so ``x._name`` is one of ours)."""
    own: set[str] = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                  and n.value.id in ("self", "cls")):
                own.add(n.attr)
            elif isinstance(n, ast.arg):
                own.add(n.arg)
            elif isinstance(n, ast.keyword) and n.arg:
                own.add(n.arg)
            elif isinstance(n, ast.alias):
                own.add((n.asname or n.name).split(".")[0])
    return own


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _dependency_names(tree: ast.Module) -> dict[str, str]:
    """Each name the module binds by importing from a dependency -> its dotted origin."""
    names: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] in DEPENDENCIES:
                    names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] in DEPENDENCIES:
            for a in n.names:
                names[a.asname or a.name] = f"{n.module}.{a.name}"
    return names


def _resolve(origin: str) -> object | None:
    """The object a dotted dependency name stands for (None if it cannot be imported here)."""
    parts = origin.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_names(c)


def _inherited_private(cls: type) -> set[str]:
    """Private names a dependency's class (and its bases from dependencies) defines or uses on itself."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] not in DEPENDENCIES:
            continue
        for name, value in vars(base).items():
            names.add(name)
            func = inspect.unwrap(value.__func__ if isinstance(value, (classmethod, staticmethod)) else value)
            if isinstance(func, types.FunctionType):
                names.update(_code_names(func.__code__))
    return {n for n in names if _private(n)}


def _dependency_bases(cls: ast.ClassDef, imported: dict[str, str]) -> list[type]:
    bases = []
    for b in cls.bases:
        root = _root_name(b)
        if root in imported:
            obj = _resolve(imported[root] + ast.unparse(b)[len(root):])
            if isinstance(obj, type):
                bases.append(obj)
    return bases


def private_uses(root: pathlib.Path = ROOT) -> list[str]:
    """``file:line: what`` for every use of a dependency's private internals outside ``multimesh/_compat/``."""
    trees = _sources(root)
    own = _own_names(trees)
    found: set[tuple[str, int, str]] = set()
    for path, tree in trees.items():
        rel = path.relative_to(root)
        if rel.parts[:2] == ALLOWED:
            continue
        imported = _dependency_names(tree)

        def report(node: ast.AST, what: str) -> None:
            found.add((str(rel), node.lineno, what))  # noqa: B023 - used at once

        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.split(".")[0] in DEPENDENCIES and any(map(_private, a.name.split("."))):
                        report(n, f"import {a.name}")
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                if n.module.split(".")[0] in DEPENDENCIES:
                    if any(map(_private, n.module.split("."))) or any(_private(a.name) for a in n.names):
                        report(n, f"from {n.module} import {', '.join(a.name for a in n.names)}")
            elif isinstance(n, ast.Attribute) and _private(n.attr):
                if _root_name(n) in imported:
                    report(n, f"{ast.unparse(n)} (of {imported[_root_name(n)]})")
                elif n.attr not in own and n.attr not in STDLIB_PUBLIC:
                    report(n, f"{ast.unparse(n)} (defined nowhere in {', '.join(PACKAGES)})")
            elif isinstance(n, ast.ClassDef):
                bases = _dependency_bases(n, imported)
                inherited = set().union(*map(_inherited_private, bases)) if bases else set()
                for m in ast.walk(n):
                    if (isinstance(m, ast.Attribute) and m.attr in inherited and isinstance(m.value, ast.Name)
                            and m.value.id in ("self", "cls")):
                        report(m, f"{ast.unparse(m)} (private to {bases[0].__qualname__})")
                    elif isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name in inherited:
                        report(m, f"def {m.name} (overrides a private method of {bases[0].__qualname__})")
    return [f"{f}:{line}: {what}" for f, line, what in sorted(found)]


def test_no_private_internals_outside_compat():
    uses = private_uses()
    assert not uses, ("dependencies' private internals used outside multimesh/_compat/ (move each behind a "
                      "function of multimesh/_compat/<dependency>.py):\n" + "\n".join(uses))


@pytest.mark.parametrize("source, found", [
    ("from jax._src import core\n", "from jax._src import core"),
    ("import orbax.checkpoint._src.futures\n", "import orbax.checkpoint._src.futures"),
    ("def f():\n    from flax.linen.module import _context\n", "from flax.linen.module import _context"),
    ("from jax.sharding import NamedSharding\nNamedSharding._internal_device_list\n",
     "NamedSharding._internal_device_list (of jax.sharding.NamedSharding)"),
    ("def f(h):\n    return h._dispatcher\n", "h._dispatcher (defined nowhere"),
    ("import orbax.checkpoint as ocp\nclass H(ocp.StandardCheckpointHandler):\n"
     "    def __init__(self):\n        self._impl = None\n", "self._impl (private to StandardCheckpointHandler)"),
    ("import orbax.checkpoint as ocp\nclass D(ocp.JsonCheckpointHandler):\n"
     "    async def _save_fn(self, x, d):\n        pass\n", "def _save_fn (overrides a private method"),
])
def test_each_kind_of_private_use_is_found(tmp_path, source, found):
    (tmp_path / "multimesh").mkdir()
    (tmp_path / "multimesh" / "m.py").write_text(textwrap.dedent(source))
    uses = private_uses(tmp_path)
    assert any(u.startswith("multimesh/m.py:") and found in u for u in uses), uses


@pytest.mark.parametrize("source", [
    "import jax\njax.__version__\n",
    "class A:\n    def __init__(self):\n        self._x = 1\n    def f(self, other):\n        return other._x\n",
    "import collections\nP = collections.namedtuple('P', 'a')\nP(1)._asdict()\n",
    "import orbax.checkpoint as ocp\nclass H(ocp.StandardCheckpointHandler):\n"
    "    def __init__(self):\n        self._mine = None\n",
])
def test_public_and_own_names_pass(tmp_path, source):
    (tmp_path / "multimesh").mkdir()
    (tmp_path / "multimesh" / "m.py").write_text(source)
    assert private_uses(tmp_path) == []


def test_compat_is_exempt(tmp_path):
    (tmp_path / "multimesh" / "_compat").mkdir(parents=True)
    (tmp_path / "multimesh" / "_compat" / "jax.py").write_text("from jax._src import core\n")
    assert private_uses(tmp_path) == []
