"""The ingest benchmark's baselines are the bench's, not the product's: `python -m bench.baseline_server
serve` answers `/_bench/parse_only` and `/_bench/read_only` next to the product's routes, `rollout-buffer
serve` has neither (404), and `rollout-buffer bench` outside the repository root says where to run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.helpers import REPO, ServerProcess, make_record


def test_the_baselines_live_in_the_bench_server_only(tmp_path: Path) -> None:
    record = make_record("g0", uid="u0")
    with ServerProcess(tmp_path / "bench", "--workers", "0", module="bench.baseline_server") as bench_server:
        parsed = httpx.post(f"{bench_server.url}/_bench/parse_only", json=record, timeout=10)
        assert parsed.status_code == 200 and parsed.json()["data"] == {"uid": "u0"}
        raw = httpx.post(f"{bench_server.url}/_bench/read_only", content=b"x" * 100, timeout=10,
                         headers={"content-type": "application/json"})
        assert raw.json()["data"] == {"bytes": 100}
        assert httpx.get(f"{bench_server.url}/health", timeout=10).status_code == 200, "the product app is served"
        assert "/_bench/parse_only" not in httpx.get(f"{bench_server.url}/openapi.json", timeout=10).text
    with ServerProcess(tmp_path / "product", "--workers", "0") as product:
        for route in ("/_bench/parse_only", "/_bench/read_only"):
            assert httpx.post(f"{product.url}{route}", json=record, timeout=10).status_code == 404, route


def test_bench_command_outside_the_repository(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "bench", "--quick"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert result.returncode == 2
    assert "run it from the repository root" in result.stderr
