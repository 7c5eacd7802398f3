#!/usr/bin/env bash
# The tested range's low end: the lowest versions pyproject.toml allows of jax, jaxlib, flax, optax and
# orbax-checkpoint, installed together into .venv-lowest (once per pyproject.toml), and the smoke subset
# on them (SPMD, MPMD, checkpoints), bounded to 15 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MULTIMESH_PYTHON:-python3.12}
pins=$("$PY" - <<'PYEOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for dep in deps:
    name, spec = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", dep).groups()
    if name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint"):
        print(f"{name}=={re.search(r'>=\s*([0-9][^,]*)', spec).group(1)}")
PYEOF
)
stamp=.venv-lowest/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  rm -rf .venv-lowest
  "$PY" -m venv .venv-lowest
  .venv-lowest/bin/python -m pip install -q --upgrade pip
  # shellcheck disable=SC2086 - one pin per word
  .venv-lowest/bin/python -m pip install -q -e ".[test]" $pins
  touch "$stamp"
fi
echo "lowest versions: $(echo $pins)"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}
exec timeout 900 .venv-lowest/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_spmd.py tests/test_mpmd_basic.py tests/test_checkpoint.py "$@"
