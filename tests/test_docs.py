"""The guides in docs/ run: every ```python block of every docs/*.md page is executed.

Convention (every page, including pages added later): a page's ```python blocks
run in order, in one namespace, in a fresh Python process with 8 simulated CPU
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
``JAX_PLATFORMS=cpu``), the repository on ``PYTHONPATH`` and a fresh temporary
directory as the working directory. A block fenced as ```python no-run is shown
but not executed (for commands that need several hosts, say). A failing block
is reported by page and line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
#: Per page: a guide is meant to run in under ~30 s; this bounds a loaded CI machine.
PAGE_TIMEOUT_S = 300

_FENCE = re.compile(r"^(?P<indent>[ ]{0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")

#: Runs the blocks (a JSON list of [line, source]) of one page in one namespace.
_RUNNER = """
import json, sys, traceback
page, blocks = sys.argv[1], json.load(open(sys.argv[2]))
namespace = {"__name__": "__main__"}
for line, source in blocks:
    try:
        exec(compile(source, f"{page}:{line}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"\\nthe ```python block of {page} at line {line} failed", file=sys.stderr)
        sys.exit(1)
"""


def pages() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if p.name != "README.md")


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """``(first line number, info string, source)`` of each fenced block of a markdown text."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start, body = m["fence"], m["info"].strip(), i + 1, []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and not lines[i].strip().strip(fence[0])):
            body.append(lines[i])
            i += 1
        out.append((start + 1, info, "\n".join(body) + "\n"))
        i += 1
    return out


def runnable(page: Path) -> list[tuple[int, str]]:
    """The blocks of ``page`` that run: info string ``python`` (not ``python no-run``)."""
    return [(line, src) for line, info, src in code_blocks(page.read_text()) if info.split() == ["python"]]


def test_block_parser():
    text = "x\n```python\na = 1\n```\n\n```python no-run\nb = 2\n```\n````bash\nls\n````\n```python\nc = 3\n```\n"
    blocks = code_blocks(text)
    assert [(info, src) for _, info, src in blocks] == [
        ("python", "a = 1\n"), ("python no-run", "b = 2\n"), ("bash", "ls\n"), ("python", "c = 3\n")]
    assert blocks[0][0] == 3  # the first line of the block's code


def run_blocks(blocks: list[tuple[int, str]], name: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run ``blocks`` in order in one namespace, in a fresh 8-device process (the convention above)."""
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "runner.py").write_text(_RUNNER)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "MPLBACKEND": "Agg"}
    try:
        proc = subprocess.run([sys.executable, str(tmp_path / "runner.py"), name, str(tmp_path / "blocks.json")],
                              check=False, cwd=work, env=env, capture_output=True, text=True,
                              timeout=PAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} took more than {PAGE_TIMEOUT_S} s")
    assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


#: Pages whose code takes long (half a minute, or 6 to 10 s where it starts processes or trains): they run
#: with the long checks (``-m slow``, in CI too), to keep the default suite under 15 minutes.
LONG_PAGES = {"implicit-tasks.md", "your-model.md", "multiprocess.md", "pipelines.md", "trainer.md", "moe.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p.name in LONG_PAGES else p
                                  for p in pages()], ids=lambda p: p.name)
def test_page_runs(page, tmp_path):
    blocks = runnable(page)
    if not blocks:
        pytest.fail(f"{page.name} has no ```python block to run; a guide shows code that runs")
    run_blocks(blocks, f"docs/{page.name}", tmp_path)


def test_readme_and_index_link_every_guide():
    readme, index = (REPO / "README.md").read_text(), (DOCS / "README.md").read_text()
    for page in pages():
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"
        assert f"({page.name})" in index, f"docs/README.md does not link {page.name}"


def test_readme_checkpoint_snippet_runs(tmp_path):
    """The README's checkpoint section shows code that runs (same conditions as a docs page)."""
    blocks = [(line, src) for line, info, src in code_blocks(readme_section("Checkpoints"))
              if info.split() == ["python"]]
    assert blocks, "the README's checkpoint section has no ```python block"
    proc = run_blocks(blocks, "README.md#checkpoints", tmp_path)
    # arrays compared across two meshes make XLA replicate them with a warning on stderr; the
    # example compares on the host; nothing else is logged either
    assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr and not proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 3)
    return text[start:] if end < 0 else text[start:end]


@pytest.mark.parametrize("title", ["SPMD: a one-device step, sharded by rules", "Your model as a pipeline"])
def test_readme_examples_run(title, tmp_path):
    """The README's front-page examples run as shown (same conditions as a docs page)."""
    blocks = [(line, src) for line, info, src in code_blocks(readme_section(title)) if info.split() == ["python"]]
    assert blocks, f"the README's section {title!r} has no ```python block"
    run_blocks(blocks, f"README.md#{title}", tmp_path)
