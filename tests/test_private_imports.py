"""Dependencies' private internals are used only in `multimesh/_compat/`.

Private: a module, name or attribute whose name starts with one underscore (``jax._src``,
``from flax.linen.module import _context``, ``handler._metadata_key``; dunders such as ``__version__`` are
public), and the few fields of JAX's internal objects that carry no underscore (`INTERNAL_FIELDS`:
``eqn.ctx``). Found from the source's AST, everywhere in multimesh/, trainers/ and models/ but
``multimesh/_compat/``:

1. imports of a private module or name of a dependency;
2. a private attribute touched (read, written or deleted as ``x._name``, or named to
   ``getattr``/``setattr``/``hasattr``/``delattr``) on anything but ``self``, ``cls`` or ``super()``:
   multimesh uses its own private attributes on the object that owns them, so a private attribute of
   another object is a dependency's (``self._mgr._directory``: Orbax's manager's, although multimesh has a
   ``_directory`` of its own; ``getattr(obj, "_options")``; ``sharding._internal_device_list``), except the
   few multimesh names listed in `OWN_SHARED`, each with the class that defines it;
3. in a class derived from a dependency's class, a private name of that class (on ``self``, ``cls`` or
   ``super()``, or a method overriding one): ``self._impl``, ``async def _save_fn``;
4. a field of `INTERNAL_FIELDS` (``eqn.ctx``) on anything but ``self`` or ``cls``.
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
#: multimesh's own private attributes that a function outside their class uses, on an object of that class
#: (the one exception to rule 2): name -> the class defining it (checked by
#: `test_each_shared_private_name_is_defined_by_its_class`).
OWN_SHARED = {
    "_abstract_batch": "multimesh.run.spmd.Parallelized",  # the batch's shapes, to estimate the step's program
    "_order": "multimesh.schedules.order.Schedule",  # the actions in order, compared by __eq__ with another's
    "_part": "multimesh.checkpoint.checksum.Hasher",  # starts one leaf's hash, called by the leaf loop beside it
    "_shadowed": "multimesh.trace.implicit.Registration",  # registrations already warned about, by the warning
    "_watch": "multimesh.core.presence.Presence",  # the thread body watching one peer, started by serve/join
}
#: Fields of JAX's internal objects without an underscore: name -> what it is.
INTERNAL_FIELDS = {"ctx": "JaxprEqn.ctx, a jax._src.core.JaxprEqnContext whose fields change between releases"}
#: Receivers of multimesh's own private attributes (an object's own, in its class's methods).
OWN_RECEIVERS = frozenset({"self", "cls"})
#: The built-ins that take an attribute's name as a string.
ATTRIBUTE_FUNCTIONS = frozenset({"getattr", "setattr", "hasattr", "delattr"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources(root: pathlib.Path) -> dict[pathlib.Path, ast.Module]:
    files = sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))
    return {p: ast.parse(p.read_text(), str(p)) for p in files}


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _on_own_object(receiver: ast.expr) -> bool:
    """Whether ``receiver`` is ``self``, ``cls`` or ``super()``."""
    return ((isinstance(receiver, ast.Name) and receiver.id in OWN_RECEIVERS)
            or (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super"))


def _attribute_uses(tree: ast.AST) -> Iterator[tuple[ast.AST, ast.expr, str, str]]:
    """``(node, receiver, name, source)`` for each attribute touched by name: ``receiver.name`` and
    ``getattr(receiver, "name", ...)`` (and ``setattr``, ``hasattr``, ``delattr``)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute):
            yield n, n.value, n.attr, ast.unparse(n)
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ATTRIBUTE_FUNCTIONS
              and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)):
            yield n, n.args[0], n.args[1].value, ast.unparse(n)


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
            elif isinstance(n, ast.ClassDef):
                bases = _dependency_bases(n, imported)
                inherited = set().union(*map(_inherited_private, bases)) if bases else set()
                for m, receiver, name, source in _attribute_uses(n):
                    if name in inherited and _on_own_object(receiver):
                        report(m, f"{source} (private to {bases[0].__qualname__})")
                for m in ast.walk(n):
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name in inherited:
                        report(m, f"def {m.name} (overrides a private method of {bases[0].__qualname__})")
        for n, receiver, name, source in _attribute_uses(tree):
            base = _root_name(receiver) if isinstance(receiver, (ast.Name, ast.Attribute)) else None
            if name in INTERNAL_FIELDS and not (isinstance(receiver, ast.Name) and receiver.id in OWN_RECEIVERS):
                report(n, f"{source} ({INTERNAL_FIELDS[name]})")
            elif not _private(name) or name in STDLIB_PUBLIC or _on_own_object(receiver):
                continue
            elif base in imported:
                report(n, f"{source} (of {imported[base]})")
            elif name not in OWN_SHARED:
                report(n, f"{source} (a private attribute of {ast.unparse(receiver)}, not of self or cls)")
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
    ("def f(h):\n    return h._dispatcher\n", "h._dispatcher (a private attribute of h, not of self or cls)"),
    # a private attribute of another object, although multimesh's own class has one of that name
    ("class Manager:\n    def __init__(self, d, mgr):\n        self._directory = d\n        self._mgr = mgr\n"
     "    def where(self):\n        return self._mgr._directory\n",
     "6: self._mgr._directory (a private attribute of self._mgr, not of self or cls)"),
    ("def f(obj):\n    return getattr(obj, '_options')\n", "getattr(obj, '_options') (a private attribute of obj"),
    ("def f(a):\n    a._committed = True\n", "a._committed (a private attribute of a"),
    ("def f(m):\n    return hasattr(m, '_devices')\n", "hasattr(m, '_devices')"),
    ("def f(eqn):\n    with eqn.ctx.manager:\n        pass\n", "eqn.ctx (JaxprEqn.ctx"),
    ("import orbax.checkpoint as ocp\nclass H(ocp.StandardCheckpointHandler):\n"
     "    def __init__(self):\n        self._impl = None\n", "self._impl (private to StandardCheckpointHandler)"),
    ("import orbax.checkpoint as ocp\nclass D(ocp.JsonCheckpointHandler):\n"
     "    async def _save_fn(self, x, d):\n        pass\n", "def _save_fn (overrides a private method"),
    ("import orbax.checkpoint as ocp\nclass D(ocp.JsonCheckpointHandler):\n"
     "    async def save(self, x, d):\n        await super()._save_fn(x, d)\n",
     "super()._save_fn (private to JsonCheckpointHandler)"),
    ("import orbax.checkpoint as ocp\nclass H(ocp.StandardCheckpointHandler):\n"
     "    def impl(self):\n        return getattr(self, '_impl')\n", "getattr(self, '_impl') (private to"),
])
def test_each_kind_of_private_use_is_found(tmp_path, source, found):
    (tmp_path / "multimesh").mkdir()
    (tmp_path / "multimesh" / "m.py").write_text(textwrap.dedent(source))
    uses = private_uses(tmp_path)
    assert any(u.startswith("multimesh/m.py:") and found in u for u in uses), uses


@pytest.mark.parametrize("source", [
    "import jax\njax.__version__\n",
    "class A:\n    def __init__(self):\n        self._x = 1\n    def f(self):\n"
    "        return self._x + getattr(self, '_x')\n",
    "class A:\n    def _f(self):\n        return 1\nclass B(A):\n    def _f(self):\n        return super()._f()\n",
    "class A:\n    @classmethod\n    def f(cls):\n        return cls._g()\n",
    "def f(presence):\n    return presence._watch\n",  # listed in OWN_SHARED
    "import collections\nP = collections.namedtuple('P', 'a')\nP(1)._asdict()\n",
    "import orbax.checkpoint as ocp\nclass H(ocp.StandardCheckpointHandler):\n"
    "    def __init__(self):\n        self._mine = None\n",
])
def test_public_and_own_names_pass(tmp_path, source):
    (tmp_path / "multimesh").mkdir()
    (tmp_path / "multimesh" / "m.py").write_text(source)
    assert private_uses(tmp_path) == []


def test_each_shared_private_name_is_defined_by_its_class():
    """Each name of `OWN_SHARED` is a method, field or ``self.<name> =`` of the multimesh class it names."""
    for name, qualified in OWN_SHARED.items():
        module, cls_name = qualified.rsplit(".", 1)
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
        defined = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        defined |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        defined |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name) and n.value.id == "self"}
        assert name in defined, f"OWN_SHARED: {qualified} defines no {name}"


def test_compat_is_exempt(tmp_path):
    (tmp_path / "multimesh" / "_compat").mkdir(parents=True)
    (tmp_path / "multimesh" / "_compat" / "jax.py").write_text("from jax._src import core\n")
    assert private_uses(tmp_path) == []
