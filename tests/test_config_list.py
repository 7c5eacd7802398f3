"""Every config in configs/ is named where a newcomer looks for it: the README's table and
``multimesh-train --help``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainers.cli import config_names, main

REPO = Path(__file__).resolve().parent.parent


def readme_configs() -> set[str]:
    """The configs the README's table names (the table after "Every config in `configs/`")."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("Every config in `configs/`"):].split("\n\n")[1]
    return set(re.findall(r"^\| `([\w.-]+)` \|", table, re.M))


def test_the_readme_names_every_config():
    assert readme_configs() == set(config_names()) == {p.stem for p in (REPO / "configs").glob("*.yaml")}


def test_the_help_names_every_config(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out.split("configs (in configs/")[1].split("overrides:")[0]
    assert set(re.findall(r"[\w.-]+", listed.split("\n", 1)[1])) == set(config_names())
