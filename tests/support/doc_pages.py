"""The project's documentation as text: README.md and the documentation site's pages (docs/*.md, the site
mkdocs.yml builds). Tests that check a documented sentence or run a documented block read it from here, so a
sentence moved between the README and a page is still found, and one deleted fails its test."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.helpers import REPO

# a fenced bash block right after `<!-- walkthrough: NAME -->`: the blocks tests/cli/test_readme_walkthrough.py runs
MARKER = re.compile(r"<!-- walkthrough: (?P<name>[\w-]+) -->\n```bash\n(?P<body>.*?)\n```", re.DOTALL)


def doc_files() -> list[Path]:
    """README.md first, then every page of the site, by name."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def doc_text(path: Path) -> str:
    return path.read_text()


def all_docs() -> str:
    """Every documentation file's text, one after the other."""
    return "\n\n".join(doc_text(path) for path in doc_files())


def marked_blocks() -> dict[str, tuple[Path, str]]:
    """Every walkthrough block of the README and the pages: name -> (file, body). A name used twice is an error,
    so a block copied between files cannot shadow the one a test runs."""
    blocks: dict[str, tuple[Path, str]] = {}
    for path in doc_files():
        for match in MARKER.finditer(doc_text(path)):
            name = match["name"]
            if name in blocks:
                raise ValueError(f"walkthrough block {name!r} is in both {blocks[name][0].name} and {path.name}")
            blocks[name] = (path, match["body"])
    return blocks
