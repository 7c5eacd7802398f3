"""Check that every process of a multi-process run was given the same values (a config, a version).

Processes of one run must run the same program on the same settings; given different ones they hang,
train on mixed settings or write incomplete checkpoints, long after starting. `agree` compares them at
once: each process publishes its values through the coordination service's key-value store (no
compile, no devices), reads everyone's, and every process raises the same `DisagreementError` naming
each key that differs and its value on each process.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from .._compat.jax import coordination_client

__all__ = ["DisagreementError", "agree", "differences", "source_digest"]

_CALLS: dict[str, int] = defaultdict(int)  # a fresh key per call, so a name may be checked again


class DisagreementError(RuntimeError):
    """The processes of a multi-process run were given different values where they must agree."""


def agree(name: str, values: Mapping[str, Any], *, timeout_seconds: float = 30) -> None:
    """Raise `DisagreementError` in every process unless all processes passed equal ``values``.

    ``values`` maps names to JSON-serialisable values (flatten nested configs into dotted keys, so the
    message names the leaf). Call it at the same point in every process; it returns at once in a
    single-process run. ``name`` says what is compared (``"the trainer config"``) in the message.
    """
    client, n, me = coordination_client(), jax.process_count(), jax.process_index()
    if client is None or n == 1:
        return
    _CALLS[name] += 1
    prefix = f"multimesh/agree/{name}/{_CALLS[name]}"
    mine = json.dumps(dict(values), sort_keys=True, default=repr)
    client.key_value_set(f"{prefix}/{me}", mine)
    timeout_ms = int(timeout_seconds * 1000)
    published: dict[int, dict[str, Any]] = {}
    for p in range(n):
        try:
            published[p] = json.loads(mine if p == me else client.blocking_key_value_get(f"{prefix}/{p}", timeout_ms))
        except jax.errors.JaxRuntimeError as e:
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DisagreementError(f"process {me}: process {p} did not publish {name} within {timeout_seconds:g} "
                                    f"s (it stopped, or does not run the same program: {first_line})") from None
    # every process has read every value before any may leave (process 0 holds the store)
    client.wait_at_barrier(f"{prefix}/read", timeout_ms)
    diffs = differences(published)
    if diffs:
        _leave_after_the_others(client, prefix, n, me, timeout_ms)
        shown = "\n  ".join(diffs[:20]) + (f"\n  ... and {len(diffs) - 20} more" if len(diffs) > 20 else "")
        raise DisagreementError(f"the {n} processes were given different {name} ({len(diffs)} key(s) differ):\n  "
                                f"{shown}\ngive every process the same {name}")


#: How long process 0 lets the others go before it stops: its exit ends the coordination service, and a
#: process still talking to it then aborts (JAX ends it from C++) instead of raising the error.
_GRACE_SECONDS = 2.0


def _leave_after_the_others(client: Any, prefix: str, n: int, me: int, timeout_ms: int) -> None:
    """Before every process raises: each other process says it is leaving, and process 0 (which holds the
    service) waits for that, and a moment more, so that it is the last to go."""
    if me != 0:
        client.key_value_set(f"{prefix}/leaving/{me}", "1")
        return
    for p in range(1, n):
        try:
            client.blocking_key_value_get(f"{prefix}/leaving/{p}", min(timeout_ms, 10_000))
        except jax.errors.JaxRuntimeError:
            pass  # it is gone already
    time.sleep(_GRACE_SECONDS)


def differences(published: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """``"key: v1 on process 0, v2 on processes [1, 2]"`` for each key whose value is not the same on
    every process (a key some process lacks shows as ``<unset>``)."""
    keys = sorted(set().union(*published.values()))
    lines = []
    for key in keys:
        by_value: dict[str, list[int]] = defaultdict(list)
        for p in sorted(published):
            by_value[json.dumps(published[p].get(key, "<unset>"), sort_keys=True)].append(p)
        if len(by_value) > 1:
            parts = [f"{v} on process {ps[0]}" if len(ps) == 1 else f"{v} on processes {ps}"
                     for v, ps in by_value.items()]
            lines.append(f"{key}: {', '.join(parts)}")
    return lines


def source_digest(*packages: str) -> str:
    """A short sha256 of the ``.py`` files of ``packages`` (names and contents), to tell code versions
    apart where the version number is the same (an edited checkout)."""
    digest = hashlib.sha256()
    for name in packages:
        source = importlib.import_module(name).__file__
        if source is None:
            raise ValueError(f"source_digest({name!r}): the package has no __init__.py to find its files by "
                             f"(a namespace package); give a regular package")
        root = Path(source).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
