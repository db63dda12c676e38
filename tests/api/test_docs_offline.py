"""`/docs` works on a machine without internet: rendered by a real, offline Chromium, assets from the package.

The negative control serves FastAPI's stock Swagger page (CDN assets) to the same browser and shows that the
offline browser catches exactly the failure users saw: a blank page whose requests left loopback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from aiohttp import web
from fastapi.openapi.docs import get_swagger_ui_html

from tests.support.browser import OfflineBrowser, is_loopback
from tests.support.helpers import ServerProcess

OPERATION = '.opblock-summary-path[data-path="{path}"]'


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(tmp_path_factory.mktemp("docs-data")) as server:
        yield server


class _AssetLinks(HTMLParser):
    """Every `src` and `href` in a page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.links += [value for name, value in attrs if name in ("src", "href") and value]


def test_docs_render_every_operation_in_an_offline_browser(docs_server: ServerProcess,
                                                           offline_browser: OfflineBrowser) -> None:
    spec_paths = set(httpx.get(f"{docs_server.url}/openapi.json", timeout=10).json()["paths"])
    assert "/start_rollout" in spec_paths and "/get_rollout_data" in spec_paths

    visit = offline_browser.open(f"{docs_server.url}/docs", wait_for=OPERATION.format(path="/start_rollout"))

    rendered = visit.page.eval_on_selector_all(".opblock-summary-path", "els => els.map(e => e.dataset.path)")
    assert set(rendered) == spec_paths
    assert visit.page.title() == "rollout-buffer - Swagger UI"
    assert visit.outside_requests() == []
    assert visit.failed_requests == [] and visit.page_errors == [] and visit.console_errors == []
    requested = {urlsplit(url).path for url in visit.requests}
    assert {"/static/docs/swagger-ui-bundle.js", "/static/docs/swagger-ui.css", "/openapi.json"} <= requested
    shot = visit.screenshot("docs.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_docs_page_links_only_to_files_of_the_installed_package(docs_server: ServerProcess) -> None:
    page = httpx.get(f"{docs_server.url}/docs", timeout=10)
    assert page.status_code == 200
    parser = _AssetLinks()
    parser.feed(page.text)
    assert parser.links, "the page links its script and stylesheet"
    package_static = Path(str(resources.files("fastapi_offline"))) / "static"
    for link in parser.links:
        assert link.startswith("/static/docs/"), f"{link} is not served by the buffer itself"
        served = httpx.get(f"{docs_server.url}{link}", timeout=10)
        assert served.status_code == 200, link
        assert served.content == (package_static / link.removeprefix("/static/docs/")).read_bytes()


def test_redoc_with_its_cdn_logo_is_not_served(docs_server: ServerProcess) -> None:
    """FastAPI's default `/redoc` loads ReDoc from a CDN, and ReDoc itself its logo: switched off."""
    assert httpx.get(f"{docs_server.url}/redoc", timeout=10).status_code == 404
    assert httpx.get(f"{docs_server.url}/docs/oauth2-redirect", timeout=10).status_code == 200


def test_offline_browser_catches_fastapis_stock_cdn_page(offline_browser: OfflineBrowser,
                                                         tiny_server: Callable[[web.Application], str]) -> None:
    """What `/docs` was before: FastAPI's own page, whose assets come from a CDN, renders nothing here."""
    stock = get_swagger_ui_html(openapi_url="/openapi.json", title="stock").body.decode()
    spec = {"openapi": "3.1.0", "info": {"title": "t", "version": "1"}, "paths": {"/x": {"get": {"responses": {}}}}}

    async def docs(_: web.Request) -> web.Response:
        return web.Response(text=stock, content_type="text/html")

    async def openapi(_: web.Request) -> web.Response:
        return web.json_response(spec)

    app = web.Application()
    app.router.add_get("/docs", docs)
    app.router.add_get("/openapi.json", openapi)
    url = tiny_server(app)

    links = _AssetLinks()
    links.feed(stock)
    cdn_assets = [link for link in links.links if link.endswith((".js", ".css"))]
    assert cdn_assets and not any(is_loopback(link) for link in cdn_assets)

    visit = offline_browser.open(f"{url}/docs")

    assert set(cdn_assets) <= set(visit.outside_requests())
    assert set(cdn_assets) <= {failure.split(": ")[0] for failure in visit.failed_requests}
    assert visit.page.locator(".opblock-summary-path").count() == 0
    assert any("SwaggerUIBundle is not defined" in error for error in visit.page_errors)
