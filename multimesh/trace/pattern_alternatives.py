"""The alternatives of a `register_task` pattern that match no scope of a traced step.

``register_task(r"stem|block\\.[01]", ...)`` with ``stem`` misspelt still matches ``block.0`` and
``block.1``: the step becomes a pipeline, and the misspelt part runs elsewhere (as glue, or on another
stage) without a word. So each top-level alternative of a pattern is matched on its own against the
scope names seen, and one that matches none is named, with the scope names closest to it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

__all__ = ["alternatives", "unmatched_alternatives"]


def alternatives(pattern: str) -> list[str]:
    """The top-level alternatives of ``pattern`` (split at each ``|`` outside groups, classes and escapes);
    ``[pattern]`` when it has one."""
    parts, depth, in_class, start, i = [], 0, False, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]":  # a "]" first in a class is literal
                i += 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    parts.append(pattern[start:])
    return parts


def unmatched_alternatives(pattern: str, names: Iterable[str]) -> list[tuple[str, list[str]]]:
    """``(alternative, closest scope names)`` for each alternative of ``pattern`` that fully matches none of
    ``names`` (nor, for ``module.method`` names, their module), where another alternative matches one."""
    names = sorted(set(names))
    candidates = names + sorted({n.rsplit(".", 1)[0] for n in names if "." in n})
    parts = alternatives(pattern)
    if len(parts) < 2:
        return []
    missing = []
    for part in parts:
        try:
            compiled = re.compile(part)
        except re.error:  # an alternative that is no pattern on its own (a backreference): not judged
            continue
        if not any(compiled.fullmatch(n) for n in candidates):
            missing.append((part, difflib.get_close_matches(part.replace("\\", ""), names, n=3, cutoff=0.5)))
    return missing if len(missing) < len(parts) else []
