#!/usr/bin/env bash
# Create .venv (python3.12) and install multimesh with its test dependencies, once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MULTIMESH_PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "multimesh needs python3.12 on the PATH (or MULTIMESH_PYTHON=/path/to/python3.12)" >&2; exit 1; }
# Open MPI's mpirun, for the test that launches a run with `mpirun -np 2` (tests/test_launchers.py); only
# where apt-get exists and it is missing, as root (the test is skipped without it)
if ! command -v mpirun >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin >/dev/null; } ||
    echo "could not install openmpi-bin: the mpirun test will be skipped" >&2
fi
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
