"""`GET /docs` (Swagger UI) with every asset served by this server: no CDN.

Training clusters often have no internet, and FastAPI's built-in pages load their JavaScript and CSS from
a CDN, so they render blank there. The swagger-ui dist files come from the installed `fastapi-offline`
package and are mounted under `/static/docs`; the page is FastAPI's own HTML helper pointed at them.
Create the app with `docs_url=None, redoc_url=None` and call `install_docs` instead.

There is no `/redoc`: ReDoc's bundle always loads its sidebar logo from Redocly's CDN, so it cannot be
a page that makes no outside request.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_URL = "/docs"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
STATIC_URL = "/static/docs"
ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon.png")
# swagger-ui's default `validatorUrl` is validator.swagger.io, whose badge image its standalone layout shows
# for specs not served from localhost: null, so no layout a user picks can make the page call out.
SWAGGER_PARAMETERS: dict[str, Any] = {"validatorUrl": None}


def assets_dir() -> Path:
    """The folder of the docs page's assets inside the installed `fastapi-offline` package."""
    folder = Path(str(resources.files("fastapi_offline"))) / "static"
    missing = [name for name in ASSETS if not (folder / name).is_file()]
    if missing:
        raise RuntimeError(f"fastapi-offline at {folder} lacks {', '.join(missing)}: reinstall fastapi-offline")
    return folder


def _root(request: Request) -> str:
    """The path prefix the app is served under (`root_path`, behind a proxy), as FastAPI's own pages use."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def install_docs(app: FastAPI) -> None:
    """Mount the local assets and add `/docs` and its OAuth2 redirect page to `app`."""
    app.mount(STATIC_URL, StaticFiles(directory=assets_dir()), name="docs-static")
    router = APIRouter(include_in_schema=False)

    @router.get(DOCS_URL)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = _root(request)
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=f"{root}{OAUTH2_REDIRECT_URL}",
            swagger_js_url=f"{root}{STATIC_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{STATIC_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{STATIC_URL}/favicon.png",
            swagger_ui_parameters={**(app.swagger_ui_parameters or {}), **SWAGGER_PARAMETERS},
        )

    @router.get(OAUTH2_REDIRECT_URL)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    app.include_router(router)
