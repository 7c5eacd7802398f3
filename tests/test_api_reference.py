"""The site (mkdocs + mkdocstrings, `mkdocs.yml`): the guides and the API reference build with warnings as
errors, every guide is in the navigation, every public name has an entry, and each reference page's example
runs."""

from __future__ import annotations

import html as htmllib
import importlib
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
#: page of the reference -> the module it documents
PAGES = {"jax": "multimesh.jax", "flax": "multimesh.jax.flax", "checkpoint": "multimesh.checkpoint",
         "distributed": "multimesh.distributed", "estimate": "multimesh.estimate"}
#: names that are values, not functions or classes: listed in the module's own docstring instead
VALUES = {"__version__", "PROFILES", "DEFAULT_OPTIMIZER_PATHS"}


def build_strict(root: Path, site_dir: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the project at ``root``. Not ``--quiet``: it hides strict mode's warnings
    and with them its failure (mkdocs then exits 0 on a site that aborted)."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or "mkdocs"
    return subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(site_dir)], cwd=root,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = build_strict(REPO, out)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_a_docstring_naming_a_missing_parameter_fails_the_build(tmp_path):
    """The check can fail: a project whose one docstring names a parameter its function lacks does not build."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(textwrap.dedent('''\
        def f(x: int) -> int:
            """Twice.

            Args:
              mesh: not a parameter of f.
            """
            return 2 * x
        '''))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# pkg\n\n::: pkg\n")
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    config.update(docs_dir="docs", nav=[{"pkg": "index.md"}])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    proc = build_strict(tmp_path, tmp_path / "site")
    assert proc.returncode != 0, f"a bad docstring built:\n{proc.stdout}\n{proc.stderr}"
    assert "Parameter 'mesh' does not appear in the function signature" in proc.stderr


def test_every_guide_is_in_the_navigation():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages(nav) -> set[str]:
        if isinstance(nav, str):
            return {nav}
        items = nav.values() if isinstance(nav, dict) else nav
        return set().union(*(pages(item) for item in items))

    listed = pages(config["nav"])
    site_docs = (REPO / config["docs_dir"]).resolve()

    def in_site(page: Path) -> bool:
        return page.is_relative_to(site_docs) and str(page.relative_to(site_docs)) in listed

    missing = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md") if not in_site(p.resolve()))
    assert not missing, f"mkdocs.yml's nav leaves out {missing}"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_public_name_is_documented(site, page):
    module = importlib.import_module(PAGES[page])
    html = (site / "api" / page / "index.html").read_text()
    anchors = set(re.findall(r'id="([^"]+)"', html))
    def documented(name: str) -> bool:
        if name in VALUES:
            return True
        if not getattr(getattr(module, name), "__module__", "multimesh").startswith("multimesh"):
            return f"<code>{name}</code>" in html  # a dependency's own function, re-exported: named
        return any(a == name or a.endswith("." + name) for a in anchors)

    missing = [name for name in module.__all__ if not documented(name)]
    assert not missing, f"docs/api/{page}.md leaves out {missing}"


def test_parallelize_shows_its_parameters_with_types_and_defaults(site):
    """`parallelize`'s entry names each parameter with its type and default, not ``**options``."""
    html = (site / "api" / "jax" / "index.html").read_text()
    entry = html[html.index('id="multimesh.jax.parallelize"'):]
    entry = re.sub(r"<[^>]+>", "", entry[:entry.index('class="doc doc-heading"', 100)])
    signature = " ".join(htmllib.unescape(entry).split())
    for shown in ("mesh: MeshLike = None", "donate: bool = False", "strict: bool = False",
                  'batch_spec: tuple = ("batch",)', "param_rules: PathRules | dict | Iterable | None = None"):
        assert shown in signature, f"{shown!r} is not in parallelize's signature on the page"
    assert "**options" not in signature and "**kwargs" not in signature


@pytest.mark.parametrize("page", sorted(PAGES))
def test_each_reference_page_shows_an_example_that_runs(page, tmp_path):
    """Every page of docs/api/ but the overview has a ```python example, and it runs (the guides' convention:
    a fresh process of 8 simulated devices, tests/test_docs.py)."""
    from test_docs import run_blocks, runnable

    blocks = runnable(REPO / "docs" / "api" / f"{page}.md")
    assert blocks, f"docs/api/{page}.md shows no ```python example"
    run_blocks(blocks, f"docs/api/{page}.md", tmp_path)
