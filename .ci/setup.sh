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
# The launchers the slow tests start runs with (tests/test_launchers.py): Open MPI's mpirun and a one-node
# SLURM cluster (slurmctld, slurmd, munged). Installed only where missing, apt-get exists and we are root;
# without them those tests are skipped.
missing=()
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
command -v slurmd >/dev/null 2>&1 || missing+=(slurm-wlm)
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } ||
    echo "could not install ${missing[*]}: their tests will be skipped" >&2
fi
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
