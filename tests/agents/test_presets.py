"""Harness presets fill an agent CLI's command, session variables and config files; `install` mounts the CLI's
host folder read-only and puts it first on PATH; what the run sets itself wins; bad names are 4xx fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_buffer.agents.config import AgentConfigError, parse
from rollout_buffer.tasks.contract import ServerFacts

VALUES = {"prompt": "fix it", "instance_id": "t", "session_id": "s", "api_key": "k",
          "openai_base_url": "http://127.0.0.1:8765/v1", "anthropic_base_url": "http://127.0.0.1:8765",
          "workdir": "/app", "home": "/home/agent"}


def _server(root: Path) -> ServerFacts:
    return ServerFacts(agent_sandboxes=("docker",), input_roots=(str(root),))


@pytest.mark.parametrize(("preset", "program", "variable"), [
    ("claude-code", "claude", "ANTHROPIC_BASE_URL"), ("codex", "codex", "OPENAI_BASE_URL"),
    ("mini-swe-agent", "mini", "OPENAI_BASE_URL"), ("opencode", "opencode", "OPENAI_BASE_URL")])
def test_each_preset_talks_to_its_own_session(tmp_path: Path, preset: str, program: str, variable: str) -> None:
    install = tmp_path / "cli"
    install.mkdir()
    config = parse({"agent": {"preset": preset, "install": str(install)}}, _server(tmp_path))
    argv = config.argv(VALUES)
    assert argv[0] == program and "fix it" in argv  # the instruction is one argument
    env = config.environment(VALUES)
    assert env[variable] in (VALUES["openai_base_url"], VALUES["anthropic_base_url"])
    assert env["PATH"].startswith(f"{install}/node_modules/.bin:{install}/bin:")
    assert config.sandbox_options["ro_binds"] == [str(install)]
    if preset == "codex":
        toml = config.files["~/.codex/config.toml"].format_map(VALUES)
        assert 'base_url = "http://127.0.0.1:8765/v1"' in toml and 'wire_api = "responses"' in toml
    if preset == "opencode":
        text = config.files["~/.config/opencode/opencode.json"].format_map(VALUES)
        assert '"baseURL": "http://127.0.0.1:8765/v1"' in text


def test_the_run_overrides_a_preset_and_bad_presets_are_refused(tmp_path: Path) -> None:
    config = parse({"agent": {"preset": "claude-code", "command": "claude -p {prompt}", "env": {"X": "1"}}},
                   _server(tmp_path))
    assert config.argv(VALUES) == ["claude", "-p", "fix it"]
    env = config.environment(VALUES)
    assert env["X"] == "1" and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    with pytest.raises(AgentConfigError, match="unknown preset 'aider'") as caught:
        parse({"agent": {"preset": "aider"}}, _server(tmp_path))
    assert caught.value.field == "agent.preset"
    with pytest.raises(AgentConfigError) as caught:  # the CLI folder must be under the server's input roots
        parse({"agent": {"preset": "codex", "install": "/usr/lib"}}, _server(tmp_path))
    assert caught.value.field == "agent.sandbox.options.ro_binds"
