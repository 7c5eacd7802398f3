#!/usr/bin/env bash
# The main job: set up (once), then train the example transformer on the tiny default config.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}
exec .venv/bin/python -m trainers "$@"
