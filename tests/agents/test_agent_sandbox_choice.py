"""Which backend a run's agents get: only one the server (or worker) enabled with `--agent-sandbox`, the first
by default; none enabled is a 403 naming the flag, whatever else the options say; the setting's names are
checked at start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollout_buffer.agents.config import AgentsNotAllowed, parse
from rollout_buffer.settings import Settings
from rollout_buffer.tasks.contract import ServerFacts

AGENT = {"agent": {"command": "true"}}


def test_no_backend_enabled_refuses_every_agent_command() -> None:
    for options in (AGENT, {"agent": {"command": "true", "sandbox": {"backend": "local"}}}, {"agent": "nonsense"}):
        with pytest.raises(AgentsNotAllowed) as refused:
            parse(options, ServerFacts())
        assert refused.value.status_code == 403 and "--agent-sandbox" in refused.value.reason


def test_a_run_chooses_among_the_enabled_backends() -> None:
    server = ServerFacts(agent_sandboxes=("bwrap", "local"))
    assert parse(AGENT, server).backend == "bwrap", "the first enabled is the default"
    assert parse({"agent": {"command": "true", "sandbox": {"backend": "local"}}}, server).backend == "local"
    same = {"agent": {"command": "true", "sandbox": {"backend": "rollout_buffer.agents.local:LocalSandbox"}}}
    assert parse(same, server).backend.endswith("LocalSandbox"), "a built-in's module path is that built-in"
    with pytest.raises(AgentsNotAllowed, match="docker"):
        parse({"agent": {"command": "true", "sandbox": {"backend": "docker"}}}, server)


def test_mounts_lie_under_the_input_roots(tmp_path) -> None:
    server = ServerFacts(agent_sandboxes=("bwrap",), input_roots=(str(tmp_path),))
    inside = {"agent": {"command": "true", "sandbox": {"options": {"ro_binds": [str(tmp_path / "tools")]}}}}
    assert parse(inside, server).sandbox_options["ro_binds"] == [str(tmp_path / "tools")]
    for bad in (["/etc"], [str(tmp_path / ".." / "elsewhere")], ["relative/path"]):
        with pytest.raises(Exception, match="ro_binds"):
            parse({"agent": {"command": "true", "sandbox": {"options": {"ro_binds": bad}}}}, server)


def test_the_setting_names_known_backends() -> None:
    assert Settings(agent_sandbox="bwrap,local").agent_sandbox == ["bwrap", "local"]
    assert Settings(agent_sandbox=["pkg.mod:factory"]).agent_sandbox == ["pkg.mod:factory"]
    with pytest.raises(ValidationError, match="agent-sandbox"):
        Settings(agent_sandbox=["chroot"])
