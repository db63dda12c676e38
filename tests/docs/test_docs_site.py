"""The documentation site (mkdocs.yml, docs/): built with `mkdocs build --strict` offline, every page in its
nav, and the README short, its links into the site pointing at pages and headings that exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.doc_pages import doc_files
from tests.support.helpers import REPO

# Pages other branches add; the nav names them once they are here (mkdocs.yml, commented out until then).
PENDING_PAGES = {"harbor.md", "scaling.md"}


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` with every proxy pointing at a closed port: a build that reached out would fail."""
    closed = "http://127.0.0.1:9"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HTTP_PROXY": closed, "HTTPS_PROXY": closed,
           "http_proxy": closed, "https_proxy": closed, "NO_PROXY": "", "no_proxy": ""}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)


def nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def load_config() -> dict:
    # mkdocs.yml uses no custom tags (`!!python/name` and the like), so plain YAML reads it
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


@pytest.mark.timeout(360)
def test_the_site_builds_strict_and_offline(tmp_path: Path) -> None:
    done = mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for page in nav_pages(load_config()["nav"]):
        built = tmp_path / "site" / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), f"{page} was not built"
    bench = (tmp_path / "site" / "bench" / "index.html").read_text()
    assert "Latest full run" in bench and "--8&lt;--" not in bench, "bench.md includes bench/README.md"
    architecture = (tmp_path / "site" / "architecture" / "index.html").read_text()
    assert "What may import what" in architecture


@pytest.mark.timeout(360)
def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The same build on a copy whose page links to a page that does not exist: --strict refuses it."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "docs", copy / "docs")
    (copy / "bench").mkdir()
    shutil.copy(REPO / "bench" / "README.md", copy / "bench" / "README.md")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "runs.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    done = mkdocs_build(copy / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "no-such-page.md" in done.stdout + done.stderr, done.stderr[-3000:]


def test_every_page_is_in_the_nav() -> None:
    listed = set(nav_pages(load_config()["nav"]))
    pages = {path.name for path in (REPO / "docs").glob("*.md")}
    assert listed <= pages, f"the nav names pages that do not exist: {sorted(listed - pages)}"
    missing = pages - listed
    assert not missing, f"pages no nav entry leads to (add them to mkdocs.yml's nav): {sorted(missing)}"
    text = (REPO / "mkdocs.yml").read_text()
    for pending in PENDING_PAGES - pages:  # their nav slots wait, commented out, for the pages
        assert re.search(rf"^\s*# - [^:]+: {re.escape(pending)}$", text, re.M), pending


def test_the_readme_fits_and_links_into_the_site() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "the README is the quick start; the reference is the site (docs/)"
    links = re.findall(r"\]\(((?:docs|bench)/[^)#]+)(?:#([^)]+))?\)", readme)
    assert len(links) >= 10, links
    for target, anchor in links:
        path = REPO / target
        assert path.is_file(), f"README links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
            slugs = {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in headings}
            assert anchor in slugs, f"README links to {target}#{anchor}; its headings give {sorted(slugs)}"


def test_no_doc_names_a_local_machine_path() -> None:
    for path in doc_files():
        assert "/work/" not in path.read_text(), path


def test_the_readme_opens_with_the_two_commands() -> None:
    """The install-and-serve command (run by tests/runs/test_core_lifecycle.py's default-data-dir test, the
    walkthrough's server) and the test command (tests/cli/test_packaging.py), first, exactly."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.DOTALL)
    assert blocks[:2] == [
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && rollout-buffer serve",
        ". .venv/bin/activate && python -m pytest"], blocks[:2]
    install = (REPO / "docs" / "install.md").read_text()
    assert blocks[0] in install and blocks[1] in install, "the install page repeats them"
