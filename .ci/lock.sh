#!/usr/bin/env bash
# Refresh requirements/lock.txt, the exact versions `.ci/setup.sh` installs: every package of a venv that passed
# CI (default .venv-newest, what `.ci/newest.sh` resolved from pyproject.toml's ranges), pinned, multimesh left
# out; then the README's "Tested on" line, which is read from the lock (.ci/tested_on.py --write).
#   bash .ci/lock.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-newest}
[ -x "$venv/bin/python" ] || { echo "lock.sh: no venv at $venv (bash .ci/newest.sh creates .venv-newest)" >&2; exit 1; }
{
  echo "# The exact versions CI passed with; .ci/setup.sh installs them with pip install -c (a constraints file:"
  echo "# it pins, it adds nothing). pyproject.toml keeps the ranges a plain pip install resolves."
  echo "# Refresh from a venv that passed CI: bash .ci/lock.sh [VENV]"
  "$venv/bin/python" -m pip freeze --exclude-editable --all | grep -v -e '^#' -e '^-e ' -e '^multimesh[= @]' \
    -e '^pip==' -e '^setuptools==' -e '^wheel==' | LC_ALL=C sort -f
} > requirements/lock.txt
"$venv/bin/python" .ci/tested_on.py --write
echo "requirements/lock.txt: $(grep -vc '^#' requirements/lock.txt) packages from $venv"
