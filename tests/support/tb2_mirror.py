"""An operator's mirror of what Terminal-Bench 2's test.sh downloads, on loopback, and a task base image that
trusts it: what a real run needs to score TB2 tasks with their own test.sh when the internet is out of reach.

Every TB2 test.sh runs `apt-get update; apt-get install -y curl`, `curl -LsSf https://astral.sh/uv/0.9.5/
install.sh | sh` and `uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest ...`. The stand-ins:
- HTTPS, one server for `astral.sh`, `pypi.org` and `files.pythonhosted.org` (a certificate for the three names,
  signed by a test CA): `/uv/<version>/install.sh` installs uv from the `uv` wheel it serves beside it (into
  `~/.local/bin`, with Astral's `~/.local/bin/env`), `/simple/<project>/` is a PEP 503 index of the cached wheels
  and `/packages/<file>` serves them. The wheels are `pip download`ed from PyPI once, cached.
- HTTP for `deb.debian.org`: a trixie archive, empty (`apt-get update` succeeds; curl is already in the image) or
  holding the packages a task's Dockerfile installs (`running_mirror(packages=...)`: Debian trixie's own .debs,
  `apt-get download`ed from Debian's archive once, cached; their `Packages` index and `Release` made here).
The image: Debian trixie (its python3 is 3.13, so `uvx -p 3.13` downloads no Python) with curl, built with
mmdebstrap (`docker_env`), the test CA added to its trust store, `SSL_CERT_FILE` naming that store (uv reads
it), and apt's source marked trusted (the stand-in archive is unsigned). The CA is made once and cached, so the
image is built once per Engine. Requests are recorded (`Mirror.served`), so a test can tell what was fetched.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import fcntl
import hashlib
import io
import json
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.docker_env import CACHE, _request, base_tarball, image_tag

UV_VERSION = "0.9.5"
WHEELS = ("pytest==8.4.1", "pytest-json-ctrf==0.3.5", f"uv=={UV_VERSION}")
HTTPS_HOSTS = ("astral.sh", "pypi.org", "files.pythonhosted.org")
SUITE, INCLUDE = "trixie", ("python3", "ca-certificates", "curl", "bash", "procps")
FOLDER = CACHE / "tb2-mirror"
RELEASE = ("Origin: rollout-buffer test mirror\nSuite: trixie\nCodename: trixie\nDate: Sat, 01 Nov 2025 00:00:00 UTC\n"
           "Architectures: amd64\nComponents: main\nSHA256:\n {sha256} {size} main/binary-amd64/Packages\n")
DEBIAN = "http://deb.debian.org/debian"  # where `debs` fetches trixie's packages from, at test set-up only
INSTALL_SH = """#!/bin/sh
# A stand-in for Astral's uv installer: uv {version} from its wheel, into $HOME/.local/bin, with the env file.
set -eu
bin="$HOME/.local/bin"
work="$(mktemp -d)"
mkdir -p "$bin"
curl -LsSf "https://astral.sh/uv/{version}/{wheel}" -o "$work/uv.whl"
python3 -m zipfile -e "$work/uv.whl" "$work/x"
install -m 0755 "$work/x/uv-{version}.data/scripts/uv" "$work/x/uv-{version}.data/scripts/uvx" "$bin/"
printf '%s\\n' 'case ":$PATH:" in *":$HOME/.local/bin:"*) ;; *) export PATH="$HOME/.local/bin:$PATH" ;; esac' \\
    > "$bin/env"
rm -rf "$work"
echo "installed uv {version} to $bin"
"""
BASE_DOCKERFILE = """FROM {base}
COPY mirror-ca.pem /usr/local/share/ca-certificates/rollout-buffer-test-mirror.crt
RUN update-ca-certificates && rm -f /etc/apt/sources.list.d/* \\
    && echo 'deb [trusted=yes] http://deb.debian.org/debian trixie main' > /etc/apt/sources.list \\
    && echo 'APT::Sandbox::User "root";' > /etc/apt/apt.conf.d/99-no-sandbox-user
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
"""


def _locked(name: str) -> io.TextIOWrapper:
    FOLDER.mkdir(parents=True, exist_ok=True)
    lock = open(FOLDER / f".{name}.lock", "w")  # noqa: SIM115 - closed by the caller's `with`
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def wheels(specs: tuple[str, ...] = WHEELS, name: str = "wheels") -> Path:
    """The wheels TB2's test.sh installs (and uv's own), or `specs` into folder `name`, downloaded from PyPI once
    into the cache (for Python 3.13, trixie's)."""
    folder = FOLDER / name
    with _locked(name):
        if not (folder / ".complete").exists():
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                                   "--python-version", "3.13", "--dest", str(folder), *specs],
                                  capture_output=True, text=True, timeout=300, check=False)
            if done.returncode != 0:
                pytest.fail(f"pip download of {specs} failed: {done.stderr[-2000:]}")
            (folder / ".complete").write_text("\n".join(specs))
    return folder


def debs(names: tuple[str, ...]) -> Path:
    """Debian trixie's .debs of `names` (each named, its dependencies too: apt does not resolve them here),
    `apt-get download`ed from Debian's archive once into the cache, with a private apt state (the host's is
    untouched)."""
    folder = FOLDER / "debs"
    with _locked("debs"):
        present = {p.name.split("_", 1)[0] for p in folder.glob("*.deb")}
        missing = [name for name in names if name not in present]
        if missing:
            state = folder / ".apt"
            for sub in ("lists/partial", "cache/archives/partial"):
                (state / sub).mkdir(parents=True, exist_ok=True)
            (state / "sources.list").write_text(
                f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {DEBIAN} trixie main\n")
            apt = ["apt-get", "-q", "-o", f"Dir::Etc::SourceList={state}/sources.list", "-o",
                   "Dir::Etc::SourceParts=/dev/null", "-o", f"Dir::State::Lists={state}/lists", "-o",
                   f"Dir::Cache={state}/cache", "-o", "APT::Architecture=amd64", "-o", "Acquire::Languages=none",
                   "-o", "APT::Sandbox::User=root"]
            for argv in ([*apt, "update"], [*apt, "download", *missing]):
                done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=300, check=False)
                if done.returncode != 0:
                    pytest.fail(f"{' '.join(argv[-2:])} from Debian trixie failed: {done.stderr[-2000:]}")
    return folder


def archive_index(folder: Path | None, names: tuple[str, ...]) -> tuple[bytes, dict[str, Path]]:
    """The trixie archive's `Packages` index of the cached .debs of `names`, and its files by pool path."""
    paragraphs, files = [], {}
    for name in names:
        deb = next((folder or Path()).glob(f"{name}_*.deb"))
        control = subprocess.run(["dpkg-deb", "-f", str(deb)], capture_output=True, text=True, timeout=30,
                                 check=True).stdout.rstrip("\n")
        files[f"pool/main/{deb.name}"] = deb
        paragraphs.append(f"{control}\nFilename: pool/main/{deb.name}\nSize: {deb.stat().st_size}\n"
                          f"SHA256: {_sha256(deb)}\n")
    return "\n".join(paragraphs).encode(), files


def _name(subject: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])


def certificate_authority() -> tuple[bytes, bytes]:
    """(CA certificate PEM, CA key PEM): made once and cached, so the image that trusts it is built once."""
    cert_path, key_path = FOLDER / "mirror-ca-2.pem", FOLDER / "mirror-ca-2.key"  # -2: with key identifiers
    with _locked("ca"):
        if not cert_path.exists():
            key = ec.generate_private_key(ec.SECP256R1())
            now = datetime.datetime.now(datetime.timezone.utc)
            cert = (x509.CertificateBuilder().subject_name(_name("rollout-buffer test mirror CA"))
                    .issuer_name(_name("rollout-buffer test mirror CA")).public_key(key.public_key())
                    .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                    .not_valid_after(now + datetime.timedelta(days=3650))
                    .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                    .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
                    .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                    .sign(key, hashes.SHA256()))
            key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
            cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path.read_bytes(), key_path.read_bytes()


def server_context(folder: Path) -> ssl.SSLContext:
    """A TLS context serving `HTTPS_HOSTS` under a fresh certificate the cached CA signs."""
    ca_pem, ca_key_pem = certificate_authority()
    ca, ca_key = x509.load_pem_x509_certificate(ca_pem), serialization.load_pem_private_key(ca_key_pem, None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(HTTPS_HOSTS[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in HTTPS_HOSTS]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]  # strict X.509 (Python 3.13's default)
    (folder / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "server.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(folder / "server.pem", folder / "server.key")
    return context


def _project(filename: str) -> str:
    return re.sub(r"[-_.]+", "-", filename.split("-", 1)[0]).lower()


@dataclass
class Mirror:
    """The running stand-ins: their loopback ports, the `--egress-*` grants that route TB2's hosts to them, and
    every path they served."""

    https_port: int = 0
    http_port: int = 0
    served: list[str] = field(default_factory=list)

    def grants(self) -> list[str]:
        return [*HTTPS_HOSTS, "deb.debian.org"]

    def mirrors(self) -> list[str]:
        return [*(f"{h}:443=127.0.0.1:{self.https_port}" for h in HTTPS_HOSTS),
                f"deb.debian.org:80=127.0.0.1:{self.http_port}"]

    def options(self, *, build: bool = False) -> list[str]:
        """The `--egress-*` options of an operator whose mirrors serve TB2's hosts to the verifier (and, with
        `build`, the Debian archive to image builds)."""
        return [*(a for h in self.grants() for a in ("--egress-verifier", h)),
                *(("--egress-build", "deb.debian.org") if build else ()),
                *(a for m in self.mirrors() for a in ("--egress-mirror", m))]


def check_solutions(dataset: Path, engine_url: str, *extra: str) -> tuple[int, dict]:
    """`rollout-buffer tasks check DATASET --solutions --force-build --json` on the Engine: (exit status, report)."""
    done = subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "tasks", "check", str(dataset), "--solutions",
                           "--force-build", "--docker-host", engine_url, "--json", *extra],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600,
                          check=False)
    return done.returncode, json.loads(done.stdout or "{}")


def mirror_app(folders: Path | tuple[Path, ...], mirror: Mirror, packages: tuple[str, ...] = ()) -> web.Application:
    folders = (folders,) if isinstance(folders, Path) else folders
    files = {p.name: p for folder in folders for p in folder.glob("*.whl")}
    index, pool = archive_index(debs(packages) if packages else None, packages)
    release = RELEASE.format(sha256=hashlib.sha256(index).hexdigest(), size=len(index))
    uv_wheels = {name.split("-")[1]: name for name in files if name.startswith("uv-")}  # by version

    @web.middleware
    async def record(request: web.Request, handler):  # type: ignore[no-untyped-def]
        mirror.served.append(f"{request.host.split(':')[0]}{request.path}")
        return await handler(request)

    async def wheel(request: web.Request) -> web.StreamResponse:
        name = request.match_info["file"]
        version = request.match_info.get("version", "")
        if name == "install.sh" and version in uv_wheels:  # astral.sh/uv/<v>/install.sh, for each uv served
            return web.Response(text=INSTALL_SH.format(version=version, wheel=uv_wheels[version]))
        return web.FileResponse(files[name]) if name in files else web.Response(status=404)

    async def simple(request: web.Request) -> web.Response:
        wanted = re.sub(r"[-_.]+", "-", request.match_info["project"]).lower()
        links = [f'<a href="https://files.pythonhosted.org/packages/{n}#sha256={_sha256(p)}">{n}</a><br>'
                 for n, p in sorted(files.items()) if _project(n) == wanted]
        if not links:
            return web.Response(status=404, text="not mirrored")
        return web.Response(text="<!DOCTYPE html><html><body>" + "".join(links) + "</body></html>",
                            content_type="text/html")

    async def apt(request: web.Request) -> web.Response:
        path = request.match_info["path"]
        if path == "dists/trixie/Release":
            return web.Response(text=release)
        if path == "dists/trixie/main/binary-amd64/Packages":
            return web.Response(body=index)
        return web.FileResponse(pool[path]) if path in pool else web.Response(status=404)

    app = web.Application(middlewares=[record])
    app.router.add_get("/uv/{version}/{file}", wheel)
    app.router.add_get("/packages/{file}", wheel)
    app.router.add_get("/simple/{project}/", simple)
    app.router.add_get("/debian/{path:.+}", apt)
    return app


_HASHES: dict[Path, str] = {}


def _sha256(path: Path) -> str:
    if path not in _HASHES:
        _HASHES[path] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _HASHES[path]


def base_image(url: str) -> str:
    """The TB2 task base image in the Engine at `url` (trixie, curl, python3.13, trusting the mirror's CA): built
    once per Engine; its tag is the hash of its rootfs recipe, its Dockerfile and the CA."""
    ca_pem, _ = certificate_authority()
    repo = "rollout-buffer-test-trixie"
    rootfs = f"{repo}:{image_tag(SUITE, INCLUDE)}"
    tag = hashlib.sha256(rootfs.encode() + BASE_DOCKERFILE.encode() + ca_pem).hexdigest()[:12]
    name = f"rollout-buffer-test-tb2:{tag}"
    with _locked("image"):
        if _request(url, "GET", f"/images/{name}/json")[0] == 200:
            return name
        if _request(url, "GET", f"/images/{rootfs}/json")[0] != 200:
            with open(base_tarball(SUITE, INCLUDE), "rb") as body:
                status, answer = _request(url, "POST", f"/images/create?fromSrc=-&repo={repo}&tag={rootfs.split(':')[1]}",
                                          body=body, timeout=300)
            if status != 200:
                pytest.fail(f"importing {rootfs} failed ({status}): {answer[-2000:]!r}")
        context = io.BytesIO()
        with tarfile.open(fileobj=context, mode="w") as tar:
            for member, data in (("Dockerfile", BASE_DOCKERFILE.format(base=rootfs).encode()), ("mirror-ca.pem", ca_pem)):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        status, answer = _request(url, "POST", f"/build?t={name}&networkmode=none&rm=1&forcerm=1",
                                  body=context.getvalue(), timeout=300)
        if status != 200 or b'"errorDetail"' in answer:
            pytest.fail(f"building {name} failed ({status}): {answer[-2000:]!r}")
    return name


def swap_from(dockerfile: Path, image: str, what: str) -> None:
    """The Dockerfile's one `FROM` line made to name `image` (the only change a published task gets here)."""
    lines = dockerfile.read_text().splitlines(keepends=True)
    froms = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    assert len(froms) == 1, f"{what}: one FROM line expected, got {len(froms)}"
    lines[froms[0]] = f"FROM {image}\n"
    dockerfile.write_text("".join(lines))


def rebase(task: Path, target: Path, image: str) -> Path:
    """A copy of a published task folder with its Dockerfile's `FROM` line (the only change) naming `image`."""
    shutil.copytree(task, target)
    swap_from(target / "environment" / "Dockerfile", image, task.name)
    return target


@contextlib.contextmanager
def running_mirror(packages: tuple[str, ...] = (), more: Path | None = None) -> Iterator[Mirror]:
    """The stand-ins on 127.0.0.1 (HTTPS and HTTP), served from a thread of their own (the server under test and
    `tasks check` run in other processes), stopped on exit; the archive holds trixie's `packages`, the index the
    wheels of folder `more` (`wheels(specs, name)`) beside TB2's."""
    mirror = Mirror()
    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory(prefix="rb-tb2-mirror-") as folder:
        app = mirror_app((wheels(), *((more,) if more else ())), mirror, packages)
        context = server_context(Path(folder))
        runner = web.AppRunner(app, access_log=None)

        async def start() -> None:
            await runner.setup()
            https, http = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context), web.TCPSite(runner, "127.0.0.1", 0)
            await https.start()
            await http.start()
            mirror.https_port = runner.addresses[0][1]
            mirror.http_port = runner.addresses[1][1]

        thread = threading.Thread(target=loop.run_forever, name="tb2-mirror", daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        try:
            yield mirror
        finally:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


def published_hashes(task: Path) -> dict[str, str]:
    """The task's `PUBLISHED.json`: each file's SHA-256 as the dataset published it (see the fixtures' README)."""
    return json.loads((task.parent / "PUBLISHED.json").read_text())[task.name]
