"""Remote rollouts for trainer-hosted engines: the trainer posts `/init`, the buffer drives the task module
against the trainer's own `/v1/chat/completions` (with a `response_mask` per call, counted by the protocol's
formula in `remote.mask`, its drift measured in `remote.drift`) and reports completion with exactly one
`POST /v1/rollout/completed`.

The service is imported lazily, so `remote.mask` stays a light import of its own. Its HTTP routes
(`POST /init`, `GET /init/{rollout_id}`) are in `rollout_buffer.api.routes.remote`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RemoteService"]


def __getattr__(name: str) -> Any:
    if name == "RemoteService":
        from rollout_buffer.remote.service import RemoteService

        return RemoteService
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
