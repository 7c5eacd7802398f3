"""The README's "Tested on" line, generated from what CI runs: the newest end from requirements/lock.txt (the
default suite's versions), the lowest end from pyproject.toml's lower bounds (the smoke subset's, .ci/lowest.sh).

  python .ci/tested_on.py           # print the line
  python .ci/tested_on.py --write   # put it in README.md and multimesh/_compat/README.md (bash .ci/lock.sh does)
  python .ci/tested_on.py --check   # exit 1, naming the file, where either differs

tests/test_tested_on.py fails when a file's line differs from the generated one.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the dependencies whose versions the line names, in its order (jaxlib is named with jax)
NAMED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")
#: the files that carry the line, each on a line of its own starting with PREFIX
FILES = ("README.md", "multimesh/_compat/README.md")
PREFIX = "Tested on "


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(lock: Path = ROOT / "requirements" / "lock.txt") -> dict[str, str]:
    """``name == version`` of every package pinned in the lock, by canonical name."""
    pins = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)", line)
        if m:
            pins[_canonical(m[1])] = m[2]
    return pins


def lowest(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """The lower bound (``>=``) of each dependency of pyproject.toml that has one, by canonical name."""
    bounds = {}
    for dep in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)[^>]*>=\s*([0-9][^,;\s]*)", dep)
        if m:
            bounds[_canonical(m[1])] = m[2]
    return bounds


def _full(version: str) -> str:
    """``0.11`` as ``0.11.0``: the release pip installs for the bound ``>=0.11``."""
    return version if version.count(".") >= 2 else version + ".0"


def line(lock: dict[str, str] | None = None, low: dict[str, str] | None = None) -> str:
    """The sentence, e.g. ``Tested on jax/jaxlib 0.11.0 to 0.12.1, flax ...``."""
    lock = locked() if lock is None else lock
    low = lowest() if low is None else low
    missing = [n for n in NAMED if n not in lock or n not in low]
    if missing:
        raise SystemExit(f"tested_on: {', '.join(missing)} not pinned in requirements/lock.txt or without a lower "
                         f"bound in pyproject.toml")
    if lock["jax"] != lock["jaxlib"] or _full(low["jax"]) != _full(low["jaxlib"]):
        raise SystemExit(f"tested_on: jax and jaxlib differ (lock {lock['jax']}/{lock['jaxlib']}, lowest "
                         f"{low['jax']}/{low['jaxlib']}); pin them alike")
    ranges = [f"{name} {_full(low[name])} to {lock[name]}" for name in ("jax", "flax", "optax", "orbax-checkpoint")]
    ranges[0] = ranges[0].replace("jax ", "jax/jaxlib ", 1)
    return (f"{PREFIX}{', '.join(ranges[:-1])} and {ranges[-1]}: the whole suite on the newest end, the exact "
            f"versions of `requirements/lock.txt`, and a smoke subset (SPMD, MPMD, checkpoints: `.ci/lowest.sh`) "
            f"on the lowest, pyproject.toml's lower bounds.")


def stale(expected: str) -> list[str]:
    """The files of FILES whose "Tested on" line is not ``expected``."""
    return [f for f in FILES if expected not in (ROOT / f).read_text().splitlines()]


def write(expected: str) -> None:
    for f in FILES:
        path = ROOT / f
        text = path.read_text()
        new, count = re.subn(rf"^{PREFIX}.*$", lambda _: expected, text, count=1, flags=re.M)
        if not count:
            raise SystemExit(f"tested_on: {f} has no line starting with {PREFIX!r} to replace")
        path.write_text(new)


def main(argv: list[str]) -> int:
    expected = line()
    if "--write" in argv:
        write(expected)
    elif "--check" in argv:
        bad = stale(expected)
        for f in bad:
            print(f"{f}: its {PREFIX!r} line is not the generated one; run python .ci/tested_on.py --write",
                  file=sys.stderr)
        return 1 if bad else 0
    else:
        print(expected)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
