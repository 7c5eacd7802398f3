"""Pytree bookkeeping for checkpoints: leaf paths, the saved-tree manifest,
restore targets, and the comparison of a target with what was saved."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable
from typing import Any

import jax
from jax.sharding import NamedSharding, Sharding, SingleDeviceSharding

from ..core.fmt import device_span, keypath_str
from .errors import CheckpointMismatchError
from .leaf_names import name_of_unnamed

PyTree = Any


# --------------------------------------------------------------------- paths
def path_str(keypath: tuple) -> str:
    """``/``-joined readable path of a JAX key path (``opt/0/mu/w``); the root is ``<root>``."""
    return keypath_str(keypath, root="<root>")


def leaves_with_paths(tree: PyTree) -> list[tuple[str, Any]]:
    """``[(path, leaf)]`` in flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(path_str(kp), leaf) for kp, leaf in flat]


def join_path(prefix: str, path: str) -> str:
    """``path`` (relative to a subtree, ``<root>`` for the subtree itself)
    under ``prefix`` (the subtree's own path, ``""`` for the whole tree)."""
    if path == "<root>":
        return prefix or path
    return f"{prefix}/{path}" if prefix else path


def is_within(path: str, prefix: str) -> bool:
    """Whether the leaf ``path`` is ``prefix`` or lies under it (``""``: the whole tree)."""
    return not prefix or path == prefix or path.startswith(prefix + "/")


def subtree_paths(paths: Iterable[str]) -> list[str]:
    """Every leaf path and every path of an inner node above one (``a/b/c``
    gives ``a``, ``a/b``, ``a/b/c``), in first-seen order."""
    out: dict[str, None] = {}
    for p in paths:
        parts = p.split("/")
        for k in range(1, len(parts) + 1):
            out.setdefault("/".join(parts[:k]))
    return list(out)


def nearest_paths(path: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The ``candidates`` most like ``path``, for a "did you mean": close
    spellings first; else those under the deepest parent of ``path`` that
    has any; else the first few."""
    candidates = list(dict.fromkeys(candidates))
    close = difflib.get_close_matches(path, candidates, n=n, cutoff=0.6)
    if close:
        return close
    parts = path.split("/")
    for k in range(len(parts) - 1, 0, -1):
        parent = "/".join(parts[:k]) + "/"
        under = [c for c in candidates if c.startswith(parent)]
        if under:
            return under[:n]
    return candidates[:n]


def is_prng_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key dtype (``jax.random.key``)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


# ------------------------------------------------------------------ manifest
@dataclasses.dataclass(frozen=True)
class LeafRecord:
    """What the checkpoint records about one saved leaf.

    ``sharding`` is a JSON dict: ``{"kind": "named", "mesh": i, "spec": [...]}``
    (``i`` indexes the manifest's ``meshes``), ``{"kind": "single_device",
    "device": id}``, or ``{"kind": <class name>, "devices": [ids]}``.

    ``path`` is the leaf's full key path, through a Flax box's ``value``
    attribute (``params/Dense_0/kernel/value``); ``name`` is the path as the
    sharding report spells it (``params/Dense_0/kernel``), see
    ``leaf_names``. Manifests written before names were recorded have none:
    ``name`` is then derived from ``path``.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    sharding: dict
    nbytes: int = 0
    checksum: str | None = None
    recorded_name: str | None = None

    @property
    def name(self) -> str:
        """The leaf's path as ``step_fn.report()`` and ``sharding.txt`` spell it."""
        return self.recorded_name if self.recorded_name is not None else name_of_unnamed(self.path)

    def to_json(self) -> dict:
        out = {"path": self.path, "shape": list(self.shape), "dtype": self.dtype,
               "sharding": self.sharding, "nbytes": self.nbytes, "checksum": self.checksum}
        if self.recorded_name is not None:
            out["name"] = self.recorded_name
        return out

    @classmethod
    def from_json(cls, d: dict) -> LeafRecord:
        return cls(d["path"], tuple(d["shape"]), d["dtype"], d.get("sharding") or {},
                   int(d.get("nbytes", 0)), d.get("checksum"), d.get("name"))


@dataclasses.dataclass(frozen=True)
class MeshRecord:
    """A mesh used by saved leaves: axis names, shape and device ids (row-major)."""

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    device_ids: tuple[int, ...]

    def to_json(self) -> dict:
        return {"axis_names": list(self.axis_names), "shape": list(self.shape),
                "device_ids": list(self.device_ids)}

    @classmethod
    def from_json(cls, d: dict) -> MeshRecord:
        return cls(tuple(d["axis_names"]), tuple(d["shape"]), tuple(d["device_ids"]))

    def describe(self) -> str:
        axes = " x ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        return f"{axes or '()'} on devices {device_span(self.device_ids, empty="[]")}"


def spec_str(spec: list | None) -> str:
    """``P('data', None)`` from the JSON form of a PartitionSpec."""
    if spec is None:
        return "?"

    def one(e):
        if e is None:
            return "None"
        if isinstance(e, list):
            return "(" + ", ".join(repr(a) for a in e) + ("," if len(e) == 1 else "") + ")"
        return repr(e)

    return "P(" + ", ".join(one(e) for e in spec) + ")"


def sharding_str(rec: dict) -> str:
    """One-line description of a recorded sharding."""
    kind = rec.get("kind")
    if kind == "named":
        return f"mesh{rec['mesh']} {spec_str(rec.get('spec'))}"
    if kind == "single_device":
        return f"device {rec.get('device')}"
    return f"{kind} on devices {device_span(rec.get('devices', []), empty='[]')}"


def _spec_json(spec) -> list:
    out = []
    for e in spec:
        out.append(list(e) if isinstance(e, tuple) else e)
    return out


def _device_ids(s: Sharding) -> list[int]:
    """The ids of the devices ``s`` spans, in order."""
    devices: set[jax.Device] = s.device_set  # the public type: the alias in jax's own hints is no type to mypy
    return sorted(int(d.id) for d in devices)


def build_manifest(
    named_leaves: list[tuple[str, jax.Array]], checksums: list[str] | None, names: list[str] | None = None,
) -> tuple[list[LeafRecord], list[MeshRecord]]:
    """Records (path, shape, dtype, sharding, checksum, name) for every saved leaf; ``names`` (see
    ``leaf_names``) in the order of ``named_leaves``."""
    meshes: list[MeshRecord] = []
    index: dict[MeshRecord, int] = {}
    records = []
    for i, (path, x) in enumerate(named_leaves):
        s = x.sharding
        if isinstance(s, NamedSharding):
            m = MeshRecord(tuple(str(a) for a in s.mesh.axis_names),
                           tuple(int(d) for d in s.mesh.devices.shape),
                           tuple(int(d.id) for d in s.mesh.devices.flat))
            if m not in index:
                index[m] = len(meshes)
                meshes.append(m)
            desc = {"kind": "named", "mesh": index[m], "spec": _spec_json(s.spec)}
        elif isinstance(s, SingleDeviceSharding):
            desc = {"kind": "single_device", "device": _device_ids(s)[0]}
        else:
            desc = {"kind": type(s).__name__, "devices": _device_ids(s)}
        size = jax.random.key_data(x).nbytes if is_prng_key(x.dtype) else x.nbytes
        records.append(LeafRecord(path, tuple(int(d) for d in x.shape), str(x.dtype), desc,
                                  int(size), checksums[i] if checksums else None,
                                  names[i] if names is not None else None))
    return records, meshes


# ------------------------------------------------------------------- targets
def abstract_target(tree: PyTree, shardings: PyTree) -> PyTree:
    """Builds a restore target: ``ShapeDtypeStruct(shape, dtype, sharding=...)``.

    Args:
        tree: a pytree whose leaves have ``.shape`` and ``.dtype`` (arrays,
            ``jax.ShapeDtypeStruct`` such as the output of ``jax.eval_shape``).
        shardings: a pytree of ``jax.sharding.Sharding`` with the same structure
            as ``tree``, or a prefix of it (one sharding applies to a whole
            subtree; a single sharding to everything).

    Returns:
        The pytree of ``jax.ShapeDtypeStruct`` to pass as ``restore(target=...)``.
    """

    def one(s, sub):
        if not isinstance(s, Sharding):
            raise TypeError(f"expected a jax.sharding.Sharding in `shardings`, got {type(s).__name__}")
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), sub)

    return jax.tree.map(one, shardings, tree, is_leaf=lambda x: isinstance(x, Sharding))


def _is_parallelized(x: Any) -> bool:
    """A function built by ``parallelize`` (duck-typed: this module does not
    import the compiler). Only pytree leaves qualify, so a state container that
    happens to have an ``abstract_params`` field is never mistaken for one."""
    return hasattr(x, "abstract_params") and jax.tree_util.treedef_is_leaf(jax.tree.structure(x))


def expand_parallelized(target: PyTree) -> PyTree:
    """Replaces every function built by ``parallelize`` in ``target`` (the whole
    target, or a subtree of it) by its ``abstract_params``: the state's layout
    under that function's rules and mesh(es)."""
    return jax.tree.map(lambda x: x.abstract_params if _is_parallelized(x) else x, target)


def normalize_target(target: PyTree) -> PyTree:
    """Target leaves as ``ShapeDtypeStruct`` with a sharding; a clear error otherwise.

    Accepts ``jax.ShapeDtypeStruct`` with ``sharding`` set, ``jax.Array`` (its
    shape, dtype and sharding are used; its values are not), and a function
    built by ``parallelize`` (its ``abstract_params``), in place of the whole
    target or of a subtree.
    """
    if target is None:
        raise TypeError(
            "restore needs target=: the layout to restore onto, e.g. "
            "target=step_fn.abstract_params (or the step function built by parallelize, "
            "or multimesh.checkpoint.abstract_target(...)); restoring onto the saved "
            "layout is not supported, it breaks on another mesh or device count")
    target = expand_parallelized(target)
    bad = []

    def one(kp, x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.ShapeDtypeStruct):
            if isinstance(getattr(x, "sharding", None), Sharding):
                return x
            bad.append(f"{path_str(kp)} (ShapeDtypeStruct without a sharding)")
            return x
        bad.append(f"{path_str(kp)} ({type(x).__name__})")
        return x

    out = jax.tree_util.tree_map_with_path(one, target)
    if bad:
        raise TypeError(
            "restore target leaves must be jax.ShapeDtypeStruct(shape, dtype, sharding=...) "
            "or jax.Array, describing the layout to restore onto (build one with "
            "multimesh.checkpoint.abstract_target). Offending leaves: " + ", ".join(bad)
        )
    return out


def check_saveable(state: PyTree) -> list[tuple[str, jax.Array]]:
    """``[(path, array)]`` of ``state``; a TypeError listing non-``jax.Array`` leaves."""
    named = leaves_with_paths(state)
    bad = [f"{p} ({type(x).__name__})" for p, x in named if not isinstance(x, jax.Array)]
    if bad:
        raise TypeError(
            "every leaf of a checkpointed state must be a jax.Array (use jnp.asarray or "
            "jax.device_put for counters and host arrays; put plain Python values in "
            "`metadata`/`data_position`). Offending leaves: " + ", ".join(bad)
        )
    if not named:
        raise ValueError("the state to save has no leaves")
    deleted = [p for p, x in named if x.is_deleted()]
    if deleted:
        raise ValueError(
            f"{len(deleted)} leaf(s) of the state to save have been deleted, e.g. {', '.join(deleted[:3])}: "
            f"a step built with donate=True frees the state it is given. Save the state the step returned "
            f"(loss, state = step(state, batch); then save state), not the one passed in")
    return named


def _indivisible(x: jax.ShapeDtypeStruct) -> str | None:
    """Why ``x.sharding`` cannot lay out ``x.shape`` (None if it can)."""
    try:
        x.sharding.shard_shape(tuple(x.shape))
    except ValueError as e:  # jax's IndivisibleError
        text = str(e)
        m = re.search(r"implies that (.*?) \(full shape", text)
        return m.group(1) if m else text.splitlines()[0]
    return None


def compare(saved: list[LeafRecord], target: PyTree, *, step: int, directory: str,
            prefix: str = "", partial: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
    """Checks ``target`` (a normalised target) leaf by leaf against the saved
    tree and returns its leaves by their saved path.

    ``target`` stands for the saved subtree at ``prefix`` (``""``: the whole
    tree). Raises ``CheckpointMismatchError`` listing every difference: a
    target leaf the checkpoint lacks (with the nearest saved paths), a saved
    leaf of the subtree the target lacks (unless ``partial``), another shape
    or dtype, a sharding that does not divide the saved shape.
    """
    want = {join_path(prefix, p): x for p, x in leaves_with_paths(target)}
    every = {r.path: r for r in saved}
    have = {p: r for p, r in every.items() if is_within(p, prefix)}
    if prefix and not have:
        near = nearest_paths(prefix, subtree_paths(every))
        raise CheckpointMismatchError(step, directory, [], [
            f"{prefix} (no saved leaf at or under this path; nearest saved: {', '.join(near) or 'none'})"], [])

    def name(p: str) -> str:  # as the sharding report and the inspector spell it (no Flax box's ``value``)
        return every[p].name if p in every else name_of_unnamed(p)

    def nearest(p: str) -> str:
        return ", ".join(map(name, nearest_paths(p, have))) or "none"

    missing = [] if partial else [f"{name(p)} {list(r.shape)} {r.dtype}" for p, r in have.items() if p not in want]
    unexpected = [f"{name(p)} {list(x.shape)} {x.dtype} (nearest saved: {nearest(p)})"
                  for p, x in want.items() if p not in have]
    mismatched = []
    for p, x in want.items():
        if p not in have:
            continue
        r = have[p]
        if tuple(x.shape) != r.shape:
            mismatched.append((name(p), "shape", str(r.shape), str(tuple(x.shape))))
        if str(x.dtype) != r.dtype:
            mismatched.append((name(p), "dtype", r.dtype, str(x.dtype)))
        if tuple(x.shape) == r.shape and (why := _indivisible(x)):
            mismatched.append((name(p), "sharding", f"shape {r.shape}",
                               (f"{x.sharding} does not divide it ({why}); pick mesh axes "
                                "whose sizes divide the dimensions they shard")))
    if missing or unexpected or mismatched:
        raise CheckpointMismatchError(step, directory, missing, unexpected, mismatched)
    return want
