"""Arrays deleted under the caller, most often by a step that donated them (``donate=True``).

JAX reports only "Array has been deleted with shape=float32[16,32]" when such an array is used again;
wherever multimesh is handed arrays (a step, a task called eagerly, a checkpoint save) it names the
leaf paths instead, with the fix.
"""

from __future__ import annotations

from typing import Any

import jax

from .fmt import keypath_str

__all__ = ["DonatedArrayError", "deleted_paths"]


class DonatedArrayError(RuntimeError):
    """An array was used after a step it was given (donated) freed it, or after it was deleted."""


def deleted_paths(tree: Any) -> list[str]:
    """The leaf paths of ``tree`` whose arrays have been deleted (donated to a step, or ``.delete()``d)."""
    return [keypath_str(p, root="(the whole tree)") for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if isinstance(x, jax.Array) and x.is_deleted()]
