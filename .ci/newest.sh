#!/usr/bin/env bash
# The range's newest end on the day: .venv-newest, multimesh with the newest versions pyproject.toml allows
# (no lock, every package upgraded), and the default suite on it, unless that set is exactly the lock's (then
# the default suite on the lock, .ci/test.sh, has run it already). Arguments are passed on to pytest.
# A passing set becomes the lock with: bash .ci/lock.sh .venv-newest
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MULTIMESH_PYTHON:-python3.12}
# a fresh venv when pyproject.toml changes: nothing left over from another set of requirements
stamp=.venv-newest/.made-for-$(sha1sum pyproject.toml | cut -c1-12)
[ -f "$stamp" ] || { rm -rf .venv-newest && "$PY" -m venv .venv-newest && touch "$stamp"; }
.venv-newest/bin/python -m pip install -q --upgrade pip
.venv-newest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test]"
# both sides without what the lock leaves out (.ci/lock.sh): pip, setuptools and wheel, which pip freeze lists on
# Python 3.12 once a package needs them (TensorBoard needs setuptools), and multimesh itself
pinned() { grep -v -e '^#' -e '^-e ' -e '^multimesh[= @]' -e '^pip==' -e '^setuptools==' -e '^wheel==' | LC_ALL=C sort -f; }
newest=$(.venv-newest/bin/python -m pip freeze --exclude-editable --all | pinned)
locked=$(pinned < requirements/lock.txt)
if [ "$newest" = "$locked" ]; then
  echo "newest versions: the same set as requirements/lock.txt; its suite ran on the lock (.ci/test.sh): not run again"
  exit 0
fi
echo "newest versions, where they differ from requirements/lock.txt:"
diff <(echo "$locked") <(echo "$newest") | sed -n 's/^< /  lock:   /p; s/^> /  newest: /p' || true
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax_cache}
exec .venv-newest/bin/python -m pytest -q -n 2 -p no:cacheprovider "$@"
