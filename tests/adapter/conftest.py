"""Every adapter test starts and ends as a fresh trainer process would: no started run, no held leases
(`slime_adapter.hooks.agent_rollout` keeps both in module state across steps)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from slime_adapter.hooks.agent_rollout import reset_state


@pytest.fixture(autouse=True)
def fresh_adapter() -> Iterator[None]:
    reset_state()
    yield
    reset_state()
