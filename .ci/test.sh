#!/usr/bin/env bash
# The test command: set up (once), then the default suite on 8 simulated CPU devices.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}
exec .venv/bin/python -m pytest -q "$@"
