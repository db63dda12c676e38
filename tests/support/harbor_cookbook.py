"""Harbor's own published examples (the harbor-cookbook recipes kept in `tests/fixtures/harbor_cookbook`), and
what running them here needs: a copy whose every Dockerfile's `FROM` names a suite image, and a stand-in for
`python:3.12-slim` (the base of multi-container's `api-server` service).

The stand-in is the TB2 base image (Debian trixie, python3, curl, trusting the mirror's CA) with what the
official Python image gives a Dockerfile: `pip` (Debian trixie's own python3-pip .debs, fetched from Debian's
archive once at set-up, installed with dpkg, no network), `python` (python-is-python3) and no PEP 668 marker
(an official Python image has none, so `pip install flask` installs system-wide as it does there)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from tests.support.docker_env import _request
from tests.support.tb2_mirror import _locked, base_image, debs, swap_from

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harbor_cookbook"
PYTHON_DEBS = ("python3-pip", "python3-wheel", "python3-packaging", "python-is-python3")
PYTHON_DOCKERFILE = """FROM {base}
COPY debs/ /tmp/debs/
RUN dpkg -i /tmp/debs/*.deb && rm -rf /tmp/debs /usr/lib/python3*/EXTERNALLY-MANAGED
"""


def published() -> dict:
    """`PUBLISHED.json`: the repository, the commit and each kept recipe's files with their SHA-256."""
    return json.loads((FIXTURES / "PUBLISHED.json").read_text())


def changed_files(recipe: str) -> list[str]:
    """The kept recipe's files whose bytes differ from the published SHA-256, and the published ones missing."""
    files = published()["recipes"][recipe]["files"]
    present = {str(p.relative_to(FIXTURES / recipe)) for p in (FIXTURES / recipe).rglob("*") if p.is_file()}
    return sorted([name for name, digest in files.items() if name not in present
                   or hashlib.sha256((FIXTURES / recipe / name).read_bytes()).hexdigest() != digest]
                  + sorted(present - set(files)))


def python_image(url: str) -> str:
    """The `python:3.12-slim` stand-in in the Engine at `url`: built once per Engine (tag: its recipe's hash)."""
    base = base_image(url)
    folder = debs(PYTHON_DEBS)
    files = sorted(next(folder.glob(f"{name}_*.deb")) for name in PYTHON_DEBS)
    recipe = base + PYTHON_DOCKERFILE + "".join(f.name for f in files)
    name = f"rollout-buffer-test-python:{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    with _locked("python-image"):
        if _request(url, "GET", f"/images/{name}/json")[0] == 200:
            return name
        context = io.BytesIO()
        with tarfile.open(fileobj=context, mode="w") as tar:
            dockerfile = PYTHON_DOCKERFILE.format(base=base).encode()
            info = tarfile.TarInfo("Dockerfile")
            info.size = len(dockerfile)
            tar.addfile(info, io.BytesIO(dockerfile))
            for deb in files:
                tar.add(deb, f"debs/{deb.name}")
        status, answer = _request(url, "POST", f"/build?t={name}&networkmode=none&rm=1&forcerm=1",
                                  body=context.getvalue(), timeout=300)
        if status != 200 or b'"errorDetail"' in answer:
            pytest.fail(f"building {name} failed ({status}): {answer[-2000:]!r}")
    return name


def rebase_all(recipe: Path, target: Path, images: dict[str, str]) -> Path:
    """A copy of a published recipe with the one `FROM` line of each Dockerfile under environment/ naming
    `images[its path]` (e.g. `environment/Dockerfile`): the only change. Every Dockerfile must be named."""
    shutil.copytree(recipe, target)
    found = sorted(str(p.relative_to(target)) for p in (target / "environment").rglob("Dockerfile"))
    assert found == sorted(images), f"{recipe.name}: Dockerfiles {found}, images given for {sorted(images)}"
    for name, image in images.items():
        swap_from(target / name, image, f"{recipe.name}/{name}")
    return target
