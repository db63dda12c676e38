"""What a request may make the server touch: files under the input roots, tokenizers, outbound URLs.

A caller of `/start_rollout` or `/init` names paths and URLs that the server then opens or calls. On a
network that is a way to read the server's files or to make it call hosts of the caller's choosing, so:

* `input_file` and a local `tokenizer_path` must resolve (symlinks and `..` resolved) to a path under one
  of the `--input-root` folders (default: the directory the server started in). A refusal says the same
  thing whether the path is outside the roots, missing, a folder or unreadable, so answers reveal nothing
  about files the caller may not read. A server on loopback (the caller is on its machine) names its
  roots in that refusal, so the fix is plain; one on a network does not list its folders.
* a tokenizer name that is not a local path is a Hugging Face hub name; it is loaded from the local cache
  only, unless `--allow-hub-downloads`. `test:<flavour>` (`test:qwen2.5`, ...) names the built-in test
  tokenizer that `rollout-buffer test-engine` serves (built on this machine; no file of the caller's).
* `--allow-url PREFIX` (repeatable) restricts the URLs the server calls: a URL is allowed when its scheme,
  host and port equal a prefix's and its path lies under the prefix's path. No prefix = any URL. Which
  URLs are checked where: `rollout_buffer.security.outbound`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")
_DEFAULT_PORTS = {"http": 80, "https": 443}
TEST_TOKENIZER_PREFIX = "test:"


class AccessDenied(ValueError):
    """A path or URL the server will not use; `field` names the request field, `status_code` the answer."""

    def __init__(self, field_name: str, message: str, status_code: int = 403) -> None:
        super().__init__(message)
        self.field = field_name
        self.status_code = status_code


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


@dataclass(frozen=True)
class TokenizerSource:
    """Where a tokenizer comes from: a resolved local folder, or a hub name (cache only unless downloads)."""

    name: str
    local: bool
    allow_download: bool


@dataclass(frozen=True)
class AccessPolicy:
    """The server's input roots, outbound URL prefixes and hub setting (built once from `Settings`)."""

    roots: tuple[Path, ...]
    allowed_urls: tuple[str, ...] = ()
    allow_hub_downloads: bool = False
    agent_sandboxes: tuple[str, ...] = ()  # `--agent-sandbox`: the backends agent commands may run in
    egress_agent: tuple[str, ...] = ()  # `--egress-agent`: hosts agents of tasks that allow internet may reach
    egress_verifier: tuple[str, ...] = ()  # `--egress-verifier`: hosts a Harbor task's verifier may reach
    egress_build: tuple[str, ...] = ()  # `--egress-build`: hosts a Harbor task's image build may reach
    egress_proxy: str = ""  # `--egress-proxy`: the upstream proxy that dials for them
    egress_mirror: tuple[str, ...] = ()  # `--egress-mirror`: allowed hosts dialed at the operator's mirror
    show_roots: bool = False  # name the roots in a refusal (a loopback server: its caller is on its machine)

    @classmethod
    def from_settings(cls, settings: Any) -> AccessPolicy:
        """Roots are resolved now: relative ones against the current directory, the default being it."""
        roots = tuple(Path(r).expanduser().resolve() for r in (settings.input_root or [Path.cwd()]))
        for url in settings.allow_url:
            _parse_prefix(url)  # a malformed prefix fails at start-up, not on the first request
        from rollout_buffer.security.auth import is_loopback

        return cls(roots=roots, allowed_urls=tuple(settings.allow_url),
                   allow_hub_downloads=bool(settings.allow_hub_downloads),
                   agent_sandboxes=tuple(getattr(settings, "agent_sandbox", ()) or ()),
                   egress_agent=tuple(getattr(settings, "egress_agent", ()) or ()),
                   egress_verifier=tuple(getattr(settings, "egress_verifier", ()) or ()),
                   egress_build=tuple(getattr(settings, "egress_build", ()) or ()),
                   egress_proxy=str(getattr(settings, "egress_proxy", "") or ""),
                   egress_mirror=tuple(getattr(settings, "egress_mirror", ()) or ()),
                   show_roots=is_loopback(str(getattr(settings, "host", "") or "")))

    # ----- files --------------------------------------------------------------------------------------

    def _inside(self, path: str) -> Path | None:
        """The real path of `path` when it lies under a root, else None (relative paths: against the cwd)."""
        if not path or "\x00" in path:
            return None
        try:
            real = Path(os.path.realpath(Path(path).expanduser()))
        except (OSError, ValueError):
            return None
        return real if any(_under(real, root) for root in self.roots) else None

    def input_file(self, path: str) -> str:
        """The real path of a readable regular file (or a Harbor dataset folder) under a root; AccessDenied
        (one message for every reason) otherwise."""
        real = self._inside(path)
        if real is None or not (real.is_file() or _task_folders(real)) or not os.access(real, os.R_OK):
            roots = (f"{', '.join(str(r) for r in self.roots)}; add a folder with --input-root" if self.show_roots
                     else "--input-root")
            raise AccessDenied("input_file", f"{path!r} is not a readable file under the server's input roots "
                                             f"({roots})")
        return str(real)

    def tokenizer(self, name: str) -> TokenizerSource:
        """Classify and check a `tokenizer_path` / `tokenizer_name`: a name that exists on disk (or looks
        like a path) is a local folder and must be under a root; anything else must look like a hub name.
        Every refusal, and a hub name missing from the cache (`tokenizer_unavailable`), says the same.
        `test:<flavour>` is the built-in test tokenizer (rollout_buffer.testing.tokenizer)."""
        if name.startswith(TEST_TOKENIZER_PREFIX):
            return _test_tokenizer(name)
        looks_local = name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name
        if looks_local or os.path.lexists(name):
            real = self._inside(name)
            if real is None or not real.is_dir():
                raise tokenizer_unavailable(name)
            return TokenizerSource(str(real), local=True, allow_download=False)
        if not _HUB_NAME.match(name) or ".." in name:
            raise tokenizer_unavailable(name)
        return TokenizerSource(name, local=False, allow_download=self.allow_hub_downloads)

    # ----- outbound URLs ------------------------------------------------------------------------------

    def url_ok(self, url: str) -> bool:
        """Whether the server may call `url`: under an allowed prefix, or no prefix is configured."""
        return not self.allowed_urls or any(url_allowed(url, prefix) for prefix in self.allowed_urls)

    def url(self, field_name: str, url: str) -> None:
        """AccessDenied unless `url_ok(url)`."""
        if not self.url_ok(url):
            raise AccessDenied(field_name, f"{url!r} is not under a URL this server may call (--allow-url)")


def _test_tokenizer(name: str) -> TokenizerSource:
    """The folder of a built-in test tokenizer, built once per machine on first use."""
    from rollout_buffer.testing.tokenizer import EXTRA_TEMPLATES, TEMPLATES, qwen_tokenizer_dir

    flavours = (*TEMPLATES, *EXTRA_TEMPLATES)
    flavour = name.removeprefix(TEST_TOKENIZER_PREFIX)
    if flavour not in flavours:
        raise AccessDenied("tokenizer_path", f"{name!r}: no built-in test tokenizer of that name (one of "
                                             f"{', '.join(TEST_TOKENIZER_PREFIX + f for f in flavours)})", 400)
    return TokenizerSource(str(qwen_tokenizer_dir(flavour)), local=True, allow_download=False)


def tokenizer_unavailable(name: str) -> AccessDenied:
    """The one refusal of a tokenizer name: not under the roots, missing, or a hub name not cached here."""
    return AccessDenied("tokenizer_path", f"{name!r}: no tokenizer folder under the server's input roots "
                                          "(--input-root) and no hub model of that name in its local cache "
                                          "(downloads: --allow-hub-downloads)")


def _parse_prefix(prefix: str) -> tuple[str, str, int, str]:
    parts = urlsplit(prefix)
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or parts.username or parts.password:
        raise ValueError(f"--allow-url {prefix!r}: give http(s)://host[:port][/path]")
    return parts.scheme, parts.hostname.lower(), parts.port or _DEFAULT_PORTS[parts.scheme], parts.path.rstrip("/")


def url_allowed(url: str, prefix: str) -> bool:
    """Whether `url` lies under `prefix`: same scheme, host and port, and a path at or below the prefix's
    (segment by segment: `/v1` allows `/v1/x`, not `/v10`). URLs with credentials are never allowed."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or parts.username or parts.password:
        return False
    scheme, host, allowed_port, path = _parse_prefix(prefix)
    if (parts.scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[parts.scheme]) != (scheme, host, allowed_port):
        return False
    target = parts.path.rstrip("/")
    if "/../" in f"{target}/" or "/./" in f"{target}/":
        return False
    return not path or target == path or target.startswith(path + "/")


def _task_folders(path: Path) -> bool:
    """Whether a folder is a Harbor dataset: a task folder, or one holding task folders (each with a
    task.toml or an instruction.md); any other folder is refused like a missing file."""
    def is_task(folder: Path) -> bool:
        return (folder / "task.toml").is_file() or (folder / "instruction.md").is_file()

    try:
        return path.is_dir() and (is_task(path) or any(p.is_dir() and is_task(p) for p in path.iterdir()))
    except OSError:
        return False
