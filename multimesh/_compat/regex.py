"""The standard library's regular-expression parser (`re._parser`, tested on Python 3.11 and 3.12).

Public replacement: none; `re` compiles a pattern but does not show its structure. Used to name what a
`register_task` pattern matches (`trace.stage_names`).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

_parser: Any = importlib.import_module("re._parser")  # Python 3.11+ (sre_parse before); no type stubs

__all__ = ["parse"]

#: One node: ``(kind, value)``. ``("LITERAL", code)``, ``("IN", [("LITERAL", code) | ("RANGE", (lo, hi)) |
#: (other kind, None)])``, ``("BRANCH", [sequence])``, ``("GROUP", sequence)``, ``("REPEAT", (lo, hi, sequence))``
#: with ``hi`` None when unbounded, ``("AT", None)`` (an anchor), anything else ``(its kind, None)``.
Node = tuple[str, Any]


def parse(pattern: str | re.Pattern) -> list[Node]:
    """``pattern`` as a sequence of `Node`s."""
    text = pattern.pattern if isinstance(pattern, re.Pattern) else pattern
    return _nodes(_parser.parse(text))


def _nodes(sequence: Any) -> list[Node]:
    return [_node(str(op), av) for op, av in sequence]


def _node(kind: str, value: Any) -> Node:
    if kind == "LITERAL":
        return kind, value
    if kind == "IN":
        return kind, [(str(k), v if str(k) in ("LITERAL", "RANGE") else None) for k, v in value]
    if kind == "BRANCH":
        return kind, [_nodes(s) for s in value[1]]
    if kind == "SUBPATTERN":
        return "GROUP", _nodes(value[3])
    if kind in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
        lo, hi, sub = value
        return "REPEAT", (lo, None if hi == _parser.MAXREPEAT else hi, _nodes(sub))
    return kind, None
