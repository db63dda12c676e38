"""Harness presets: `"agent": {"preset": NAME, "install": "/host/folder"}` fills an agent CLI's command, the
session variables it reads and its config files, so each CLI talks to its own rollout's session.

* `claude-code`: `claude -p {prompt} --output-format json`, `ANTHROPIC_BASE_URL` / `ANTHROPIC_API_KEY`, and
  `~/.claude/settings.json` allowing its file and shell tools.
* `codex`: `codex exec --dangerously-bypass-approvals-and-sandbox --skip-git-repo-check -- {prompt}` (the
  container is its sandbox) with `~/.codex/config.toml` naming a custom provider
  (`base_url` = the session's OpenAI base URL, `wire_api = "responses"`, key from `OPENAI_API_KEY`).
* `mini-swe-agent`: `mini -y --exit-immediately -l 0 -t {prompt}` with litellm's OpenAI variables
  (`OPENAI_BASE_URL`, `OPENAI_API_KEY`) and the model `openai/policy`.
* `opencode`: `opencode run {prompt}` with `~/.config/opencode/opencode.json` naming an OpenAI-compatible
  provider at the session's base URL.

The sandbox has no internet, so the CLI is either in the image or in `install`: a host folder (under the
server's input roots) mounted read-only at the same path, whose `node_modules/.bin` and `bin` go first on
PATH (an npm prefix or a Python virtual environment: `npm install --prefix DIR @anthropic-ai/claude-code`,
`python3 -m venv DIR && DIR/bin/pip install mini-swe-agent`). Any key the run also sets (`command`, `env`,
`files`, ...) replaces or extends the preset's.
"""

from __future__ import annotations

import copy
import os
from typing import Any

_CODEX_TOML = ('model = "policy"\nmodel_provider = "rollout_buffer"\n\n[model_providers.rollout_buffer]\n'
               'name = "rollout-buffer gateway"\nbase_url = "{openai_base_url}"\nenv_key = "OPENAI_API_KEY"\n'
               'wire_api = "responses"\n')
_OPENCODE = {"$schema": "https://opencode.ai/config.json", "model": "rollout/policy",
             "provider": {"rollout": {"npm": "@ai-sdk/openai-compatible", "name": "rollout-buffer gateway",
                                      "options": {"baseURL": "OPENAI_BASE_URL_PLACEHOLDER"},
                                      "models": {"policy": {"name": "policy"}}}}}

PRESETS: dict[str, dict[str, Any]] = {
    "claude-code": {"command": "claude -p {prompt} --output-format json", "api": "anthropic",
                    "env": {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"},
                    "files": {"~/.claude/settings.json": {"permissions": {"allow": ["Bash", "Edit", "Write",
                                                                                     "Read"]}}}},
    "codex": {"command": "codex exec --dangerously-bypass-approvals-and-sandbox --skip-git-repo-check -- {prompt}",
              "api": "openai",
              "files": {"~/.codex/config.toml": _CODEX_TOML}},
    "mini-swe-agent": {"command": "mini -y --exit-immediately -l 0 -t {prompt}", "api": "openai",
                       "env": {"MSWEA_MODEL_NAME": "openai/policy", "MSWEA_CONFIGURED": "true",
                               "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_SILENT_STARTUP": "1",
                               "LITELLM_LOCAL_MODEL_COST_MAP": "True"}},
    "opencode": {"command": "opencode run {prompt}", "api": "openai", "env": {"OPENCODE_DISABLE_AUTOUPDATE": "1"}},
}


class PresetError(ValueError):
    """A bad `preset` or `install` option: the field and why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def _opencode_files() -> dict[str, str]:
    import json

    text = json.dumps(_OPENCODE, indent=2).replace("{", "{{").replace("}", "}}")
    return {"~/.config/opencode/opencode.json": text.replace("OPENAI_BASE_URL_PLACEHOLDER", "{openai_base_url}")}


def expand(raw: dict[str, Any]) -> dict[str, Any]:
    """The run's `agent` options with its preset filled in (a copy; `preset` and `install` consumed)."""
    name = raw.get("preset")
    install = raw.get("install")
    if name is None and install is None:
        return raw
    out = {k: v for k, v in raw.items() if k not in ("preset", "install")}
    if name is not None:
        if name not in PRESETS:
            raise PresetError("agent.preset", f"unknown preset {name!r}; known: {sorted(PRESETS)}")
        preset = copy.deepcopy(PRESETS[name])
        if name == "opencode":
            preset["files"] = _opencode_files()
        for key, value in preset.items():
            if key in ("env", "files"):
                out[key] = {**value, **(raw.get(key) or {})}
            else:
                out.setdefault(key, value)
    if install is not None:
        if not isinstance(install, str) or not install.startswith("/"):
            raise PresetError("agent.install", "must be an absolute host folder holding the agent CLI")
        path = f"{install}/node_modules/.bin:{install}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        out["env"] = {"PATH": path, **(out.get("env") or {})}
        sandbox = copy.deepcopy(out.get("sandbox") or {})
        options = sandbox.setdefault("options", {}) if isinstance(sandbox, dict) else {}
        if isinstance(options, dict):
            options["ro_binds"] = [*(options.get("ro_binds") or []), os.path.normpath(install)]
        out["sandbox"] = sandbox
    return out
