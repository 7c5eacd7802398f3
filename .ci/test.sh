#!/usr/bin/env bash
# The test command: set up (once), then the default suite on 8 simulated CPU devices per worker, on two
# pytest-xdist workers (both cores of the CI machine). Given -m (the slow suite: its processes and timing
# bounds want the machine to themselves), -n or -p, pytest runs as asked, in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}
workers=(-n 2)
for arg in "$@"; do
  case "$arg" in -m|-m*|-n|-n*|--numprocesses*|-p) workers=() ;; esac
done
exec .venv/bin/python -m pytest -q "${workers[@]}" "$@"
