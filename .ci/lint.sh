#!/usr/bin/env bash
# The static checks: ruff (pyproject.toml [tool.ruff]) over the package, the trainer and the models.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
.venv/bin/python -m ruff check multimesh trainers models
