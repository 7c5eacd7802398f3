"""The API reference (mkdocs + mkdocstrings, `mkdocs.yml`) builds with warnings as errors and documents
every public name: each name in the ``__all__`` of the modules it covers has an entry."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: page of the reference -> the module it documents
PAGES = {"jax": "multimesh.jax", "flax": "multimesh.jax.flax", "checkpoint": "multimesh.checkpoint",
         "distributed": "multimesh.distributed", "estimate": "multimesh.estimate"}
#: names that are values, not functions or classes: listed in the module's own docstring instead
VALUES = {"__version__", "PROFILES", "DEFAULT_OPTIMIZER_PATHS"}

@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    proc = subprocess.run([mkdocs, "build", "--strict", "--quiet", "--site-dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_public_name_is_documented(site, page):
    module = importlib.import_module(PAGES[page])
    html = (site / page / "index.html").read_text()
    anchors = set(re.findall(r'id="([^"]+)"', html))
    def documented(name: str) -> bool:
        if name in VALUES:
            return True
        if not getattr(getattr(module, name), "__module__", "multimesh").startswith("multimesh"):
            return f"<code>{name}</code>" in html  # a dependency's own function, re-exported: named
        return any(a == name or a.endswith("." + name) for a in anchors)

    missing = [name for name in module.__all__ if not documented(name)]
    assert not missing, f"docs/api/{page}.md leaves out {missing}"
