#!/usr/bin/env bash
# Set up .venv (python3.12) once: multimesh, editable, with its test tools (pytest, hypothesis, ruff, mypy,
# mkdocs), at the exact versions CI passed with (requirements/lock.txt, a constraints file: a fresh clone gets
# the tested set whatever has been released since). Again only when pyproject.toml or the lock change.
# Nothing is installed outside .venv unless asked: the launchers of the slow multi-process tests (Open MPI,
# SLURM) come from apt-get only with MULTIMESH_INSTALL_LAUNCHERS=1 or CI=true.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MULTIMESH_PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "multimesh needs python3.12 on the PATH (or MULTIMESH_PYTHON=/path/to/python3.12)" >&2; exit 1; }

# The launchers tests/test_launchers.py starts runs with (slow suite): Open MPI's mpirun and a one-node SLURM
# cluster (slurmctld, slurmd, munged). System packages: installed only when asked, with apt-get, as root.
missing=()
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
command -v slurmd >/dev/null 2>&1 || missing+=(slurm-wlm)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "${MULTIMESH_INSTALL_LAUNCHERS:-}" = 1 ] || [ "${CI:-}" = true ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      echo "setup: installing ${missing[*]} system-wide with apt-get (for the slow launcher tests)"
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } ||
        echo "setup: could not install ${missing[*]}: tests/test_launchers.py's tests that need them are skipped" >&2
    else
      echo "setup: ${missing[*]} missing and cannot be installed here (needs apt-get as root): tests/test_launchers.py's tests that need them are skipped" >&2
    fi
  elif [ ! -f .venv/.launchers-noted ]; then
    echo "setup: ${missing[*]} not installed: the slow tests of tests/test_launchers.py that start runs with mpirun/srun are skipped (MULTIMESH_INSTALL_LAUNCHERS=1 bash .ci/setup.sh installs them with apt-get, as root)"
    mkdir -p .venv && touch .venv/.launchers-noted
  fi
fi

stamp=.venv/.installed-$(cat pyproject.toml requirements/lock.txt | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "setup: installing multimesh (editable) and its test tools into .venv at the versions of requirements/lock.txt"
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]" -c requirements/lock.txt
  rm -f .venv/.installed-*
  touch "$stamp"
fi
