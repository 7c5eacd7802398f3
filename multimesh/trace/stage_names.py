"""A readable default name for a `register_task` stage: what its pattern matches, not the pattern's text.

``register_task(r"stem|block\\.[01]", ...)`` without ``name=`` is named ``stem+block.0-1`` in plans, run
stats, schedules and errors: a pattern matching a few names (alternatives, character classes, bounded
repeats) is named by those names, numbered ones sharing a prefix as one range; a pattern matching
unboundedly many (``layers_(\\d+)``) by its fixed text, each variable part a ``*`` (``layers_*``).
"""

from __future__ import annotations

import itertools
import re

from .._compat.regex import Node, parse

__all__ = ["readable_name"]

#: The most names a pattern is spelt out as; more are sketched with ``*``.
MOST_NAMES = 32


def readable_name(pattern: str | re.Pattern) -> str:
    """The names ``pattern`` matches, numbered ones as ranges (``stem+block.0-1``), else its sketch."""
    text = pattern.pattern if isinstance(pattern, re.Pattern) else pattern
    nodes = parse(text)
    words = _language(nodes)
    name = _join(words) if words is not None else _sketch(nodes, top=True)
    return name or text


def _language(nodes: list[Node]) -> list[str] | None:
    """Every string the node sequence matches, in pattern order, or None if more than `MOST_NAMES`."""
    words = [""]
    for node in nodes:
        got = _node_language(node)
        if got is None:
            return None
        words = list(dict.fromkeys(a + b for a, b in itertools.product(words, got)))
        if len(words) > MOST_NAMES:
            return None
    return words


def _node_language(node: Node) -> list[str] | None:
    kind, value = node
    if kind == "LITERAL":
        return [chr(value)]
    if kind == "AT":
        return [""]
    if kind == "GROUP":
        return _language(value)
    if kind == "BRANCH":
        branches = [_language(b) for b in value]
        if any(b is None for b in branches):
            return None
        return list(dict.fromkeys(w for b in branches for w in b or ()))
    if kind == "IN":
        return _class_chars(value)
    if kind == "REPEAT":
        lo, hi, sub = value
        if hi is None or hi - lo > MOST_NAMES:
            return None
        words: list[str] = []
        for count in range(lo, hi + 1):
            got = _language(sub * count)
            if got is None:
                return None
            words.extend(got)
        return list(dict.fromkeys(words)) if len(words) <= MOST_NAMES else None
    return None


def _class_chars(items: list[Node]) -> list[str] | None:
    """A character class's characters (``[01]``, ``[0-3]``), or None for a category or a negation."""
    chars: list[str] = []
    for kind, value in items:
        if kind == "LITERAL":
            chars.append(chr(value))
        elif kind == "RANGE" and value[1] - value[0] < MOST_NAMES:
            chars.extend(chr(c) for c in range(value[0], value[1] + 1))
        else:
            return None
    return list(dict.fromkeys(chars))


def _join(words: list[str]) -> str:
    """``["stem", "block.0", "block.1"]`` as ``stem+block.0-1``: names that differ only in their last number
    as one, its numbers as ranges, in the order first met."""
    groups: dict[tuple[str, str], list[int]] = {}
    for word in words:
        m = re.fullmatch(r"(.*?)(\d+)(\D*)", word)
        if m and str(int(m.group(2))) == m.group(2):
            groups.setdefault((m.group(1), m.group(3)), []).append(int(m.group(2)))
        else:
            groups.setdefault((word, ""), [])
    return "+".join(before + _ranges(numbers) + after for (before, after), numbers in groups.items()
                    if before or numbers or after)


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _sketch(nodes: list[Node], top: bool = False) -> str:
    """The pattern's fixed text with each variable part a ``*`` (``layers_(\\d+)``: ``layers_*``)."""
    out = ""
    for node in nodes:
        kind, value = node
        words = _node_language(node)
        if words is not None and len(words) == 1:
            part = words[0]
        elif kind == "GROUP":
            part = _sketch(value)
        elif kind == "BRANCH":
            parts = [_sketch(b) for b in value]
            part = "+".join(parts) if top and len(nodes) == 1 else f"({'|'.join(parts)})"
        else:
            part = "*"
        if not (part == "*" and out.endswith("*")):
            out += part
    return out
