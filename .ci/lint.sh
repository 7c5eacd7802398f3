#!/usr/bin/env bash
# The static checks (configured in pyproject.toml): ruff over the package, the trainer and the models;
# mypy over the package.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
.venv/bin/python -m ruff check multimesh trainers models
.venv/bin/python -m mypy
