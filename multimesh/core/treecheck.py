"""Compare two pytrees and say, by path, how they differ."""

from __future__ import annotations

from typing import Any

import jax

from .metadata import path_str

__all__ = ["check_same_structure", "tree_differences"]


def _leaves_by_path(tree: Any) -> dict[str, Any]:
    return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def tree_differences(expected: Any, got: Any, *, shapes: bool = True, limit: int = 20) -> list[str]:
    """Human-readable differences: missing and unexpected paths, then shape/dtype mismatches."""
    want, have = _leaves_by_path(expected), _leaves_by_path(got)
    diffs = [f"missing: {p}" for p in want if p not in have]
    diffs += [f"unexpected: {p}" for p in have if p not in want]
    if shapes:
        for p in want.keys() & have.keys():
            a, b = want[p], have[p]
            sa, sb = tuple(getattr(a, "shape", ())), tuple(getattr(b, "shape", ()))
            if sa != sb:
                diffs.append(f"shape of {p}: expected {sa}, got {sb}")
            elif hasattr(a, "dtype") and hasattr(b, "dtype") and a.dtype != b.dtype:
                diffs.append(f"dtype of {p}: expected {a.dtype}, got {b.dtype}")
    if not diffs and jax.tree.structure(expected) != jax.tree.structure(got):
        diffs.append(f"same paths but different containers: expected {jax.tree.structure(expected)}, "
                     f"got {jax.tree.structure(got)}")
    if len(diffs) > limit:
        diffs = diffs[:limit] + [f"... and {len(diffs) - limit} more"]
    return diffs


def check_same_structure(expected: Any, got: Any, what: str) -> None:
    diffs = tree_differences(expected, got, shapes=False)
    if diffs:
        raise ValueError(
            f"{what} has a different tree structure than the one the sharded function was built for:\n  "
            + "\n  ".join(diffs)
        )
