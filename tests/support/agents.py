"""Helpers for the agent_command tests: starting a run whose agent is a command, and reading its sandboxes."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx

from tests.support.helpers import REPO
from tests.support.runtime_helpers import write_rows

SDK_AGENT = REPO / "tests" / "fixtures" / "agent_scripts" / "sdk_agent.py"


def start_agent_run(client: httpx.Client, server_url: str, tmp: Path, rows: list[dict[str, Any]], agent: dict[str, Any],
                    *, engine_url: str, tokenizer_path: str, repeats: int = 1, **extra: Any) -> httpx.Response:
    body = {"task_type": "agent_command", "input_file": str(write_rows(tmp, rows, f"in-{uuid.uuid4().hex[:6]}.jsonl")),
            "num_repeat_per_sample": repeats, "num_process": 16, "remote_engine_url": engine_url,
            "tokenizer_path": tokenizer_path, "run_id": f"agent-{uuid.uuid4().hex[:8]}",
            "remote_buffer_url": server_url, "sampling_params": {"max_tokens": 256, "temperature": 1.0},
            "agent": agent}
    body.update(extra)
    return client.post("/start_rollout", json=body)


def sandbox_root(tmp: Path) -> dict[str, Any]:
    """Sandbox options that put a run's sandboxes under `tmp` (to check that none is left behind)."""
    root = tmp / "sandboxes"
    root.mkdir(exist_ok=True)
    return {"options": {"root": str(root)}}
