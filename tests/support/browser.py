"""Headless Chromium with the outside world cut off, for tests of the server's pages (`/docs`, dashboards).

The browser is Debian's `chromium` (`/usr/bin/chromium`, or `$ROLLOUT_BUFFER_CHROMIUM`), driven by
Playwright; it is never downloaded. Outbound network is blocked twice over, so a page that needs a CDN
renders as it would on an air-gapped cluster: every host name but 127.0.0.1 fails to resolve, and every
connection goes to a proxy on a dead port, except loopback. Every request a page makes is recorded, so a
test can also assert that all of them went to loopback.

Use the `offline_browser` fixture (tests/conftest.py):

    visit = offline_browser.open(f"{server.url}/docs", wait_for='.opblock-summary-path[data-path="/x"]')
    assert visit.outside_requests() == [] and visit.page_errors == []
    visit.screenshot("docs.png")   # under the test's tmp dir
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal
from urllib.parse import urlsplit

from playwright.sync_api import BrowserContext, Page, Playwright, Request, sync_playwright

CHROMIUM = Path(os.environ.get("ROLLOUT_BUFFER_CHROMIUM", "/usr/bin/chromium"))
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
# URL schemes that never touch the network (inline data, object URLs, the blank page).
LOCAL_SCHEMES = frozenset({"data", "blob", "about"})


def dead_port() -> int:
    """A loopback port nothing listens on (bound, then released), for the proxy that blocks all traffic."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def chromium_args(proxy_port: int) -> list[str]:
    """Headless, quiet, and offline: the flags this closed network needs (Chromium's background services
    would otherwise try to reach out) plus the two network blocks."""
    return [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--proxy-server=http://127.0.0.1:{proxy_port}", "--proxy-bypass-list=127.0.0.1",
    ]


def require_chromium() -> Path:
    """The Chromium binary, or a failure that says how to install it (a test must not pass by skipping)."""
    if not os.access(CHROMIUM, os.X_OK):
        raise RuntimeError(f"no Chromium at {CHROMIUM}: `apt-get install -y chromium chromium-driver` "
                           "(or set ROLLOUT_BUFFER_CHROMIUM to a Chromium binary)")
    return CHROMIUM


def is_loopback(url: str) -> bool:
    """True for URLs that stay on this machine: loopback HTTP(S), or schemes that make no request."""
    parts = urlsplit(url)
    if parts.scheme in LOCAL_SCHEMES:
        return True
    return parts.scheme in ("http", "https", "ws", "wss") and (parts.hostname or "") in LOOPBACK_HOSTS


@dataclass
class PageVisit:
    """One opened page and what it did: every request URL, failed requests, console and script errors."""

    page: Page
    shots_dir: Path
    requests: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)

    def outside_requests(self) -> list[str]:
        """Requests that left loopback (they fail here; on a connected machine they would not)."""
        return [url for url in self.requests if not is_loopback(url)]

    def screenshot(self, name: str) -> Path:
        """Save a full-page PNG under the test's tmp dir and return its path."""
        path = self.shots_dir / name
        self.page.screenshot(path=str(path), full_page=True)
        return path


class OfflineBrowser:
    """One headless Chromium with a fresh profile (`--user-data-dir` in the test's tmp dir), network cut off."""

    def __init__(self, tmp_dir: Path, timeout_s: float = 30.0) -> None:
        self.tmp_dir = Path(tmp_dir)
        self.timeout_ms = timeout_s * 1000
        self._playwright: Playwright | None = None
        self._context: BrowserContext | None = None

    def __enter__(self) -> "OfflineBrowser":
        executable = require_chromium()
        self._playwright = sync_playwright().start()
        try:
            profile = self.tmp_dir / "chromium-profile"
            profile.mkdir(parents=True, exist_ok=False)  # fresh: no cached asset can hide a missing one
            self._context = self._playwright.chromium.launch_persistent_context(
                str(profile), executable_path=str(executable), headless=True, args=chromium_args(dead_port()),
                timeout=self.timeout_ms, viewport={"width": 1280, "height": 900}, service_workers="block",
            )
            self._context.set_default_timeout(self.timeout_ms)
        except BaseException:
            self._playwright.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self._context is not None:
                self._context.close()
        finally:
            if self._playwright is not None:
                self._playwright.stop()

    def open(self, url: str, wait_for: str | None = None,
             wait_until: Literal["commit", "domcontentloaded", "load", "networkidle"] = "networkidle") -> PageVisit:
        """Open `url` in a new tab and wait for `wait_until` (a page that streams or polls without pause
        never reaches "networkidle": use "load"), then for the `wait_for` selector."""
        assert self._context is not None, "use OfflineBrowser as a context manager"
        page = self._context.new_page()
        visit = PageVisit(page=page, shots_dir=self.tmp_dir)
        page.on("request", lambda request: visit.requests.append(request.url))
        page.on("requestfailed", lambda request: visit.failed_requests.append(_failure(request)))
        page.on("console", lambda message: visit.console_errors.append(message.text)
                if message.type == "error" else None)
        page.on("pageerror", lambda error: visit.page_errors.append(str(error)))
        page.goto(url, wait_until=wait_until)
        if wait_for is not None:
            page.wait_for_selector(wait_for, state="attached")
        return visit


def _failure(request: Request) -> str:
    return f"{request.url}: {request.failure}"

