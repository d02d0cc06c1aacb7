"""The documentation site's config and its tables of contents (`make docs` builds it strictly in CI)."""
import re
from pathlib import Path

import yaml

from posttrain.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MKDOCS = yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def nav_pages(node=MKDOCS["nav"]):
    if isinstance(node, str):
        return [node]
    items = node.values() if isinstance(node, dict) else node
    return [page for item in items for page in nav_pages(item)]


def test_nav_names_every_page_once():
    pages = nav_pages()
    assert sorted(pages) == sorted(p.name for p in DOCS.glob("*.md"))
    assert len(pages) == len(set(pages))


def test_theme_highlights_copies_wraps_and_searches_offline():
    theme = MKDOCS["theme"]
    assert theme["name"] == "material"
    assert theme["font"] is False  # no web-font download at build or view time
    assert "content.code.copy" in theme["features"]
    assert MKDOCS["plugins"] == ["search"]  # nothing that fetches from the network
    extensions = [e if isinstance(e, str) else next(iter(e)) for e in MKDOCS["markdown_extensions"]]
    assert {"pymdownx.highlight", "pymdownx.superfences"} <= set(extensions)
    css = "".join((DOCS / path).read_text() for path in MKDOCS["extra_css"])
    assert re.search(r"pre > code\s*\{[^}]*white-space:\s*pre-wrap", css)


def test_home_page_starts_quickly_and_links_every_page():
    home = (DOCS / "index.md").read_text()
    quick = home.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    for step in ("make setup", "source .venv/bin/activate", "posttrain init-tiny", "posttrain sft"):
        assert step in quick
    table = home.split("## Where to read next", 1)[1]
    linked = set(re.findall(r"^\| \[[^]]+\]\(([\w-]+\.md)\)", table, re.M))
    assert linked == set(nav_pages()) - {"index.md"}


def test_getting_started_lists_every_command():
    guide = (DOCS / "getting-started.md").read_text()
    rows = re.findall(r"^\| `posttrain ([\w-]+)", guide, re.M)
    assert set(COMMANDS) <= set(rows)
