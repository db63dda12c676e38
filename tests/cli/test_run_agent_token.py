"""scripts/run_agent.sh and the buffer's token: a given token reaches both the buffer and the training
command through the environment; a buffer bound beyond loopback without one gets a generated token file."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

from tests.cli.test_run_agent_script import SCRIPT, script_env
from tests.support.helpers import free_port

# A stand-in for training: reads the token as the adapter does (slime_adapter.auth) and probes the buffer.
TRAIN = """
import json, os, sys, urllib.error, urllib.request
sys.path.insert(0, os.environ["REPO"])
from slime_adapter.auth import token_from
url = sys.argv[sys.argv.index("--rollout-buffer-url") + 1]
token = token_from(None)
def status(headers):
    try:
        return urllib.request.urlopen(urllib.request.Request(url + "/tasks", headers=headers), timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code
print(json.dumps({"token": token, "anonymous": status({}), "with_token": status({"Authorization": f"Bearer {token}"}),
                  "file": os.environ.get("ROLLOUT_BUFFER_AUTH_TOKEN_FILE")}), flush=True)
"""


def run_script(tmp_path: Path, **env: str) -> dict[str, object]:
    port = free_port()
    environment = {**script_env(tmp_path, port), "REPO": str(SCRIPT.parent.parent), **env}
    done = subprocess.run([str(SCRIPT), "--", sys.executable, "-c", TRAIN], env=environment, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["stderr"] = done.stderr
    return report


def test_a_given_token_reaches_buffer_and_training(tmp_path: Path) -> None:
    report = run_script(tmp_path, ROLLOUT_BUFFER_AUTH_TOKEN="given-token-123")
    assert report["token"] == "given-token-123"
    assert (report["anonymous"], report["with_token"]) == (401, 200)


def test_a_buffer_beyond_loopback_gets_a_generated_token(tmp_path: Path) -> None:
    report = run_script(tmp_path, BUFFER_HOST="0.0.0.0")
    token_file = tmp_path / "data" / "auth_token"
    assert report["file"] == str(token_file) and token_file.is_file()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600, "readable by its owner only"
    assert report["token"] == token_file.read_text().strip() and len(str(report["token"])) >= 32
    assert (report["anonymous"], report["with_token"]) == (401, 200)
    assert "its token is in" in str(report["stderr"])


def test_loopback_without_a_token_stays_open(tmp_path: Path) -> None:
    report = run_script(tmp_path)
    assert report["token"] is None and report["anonymous"] == 200
    assert not (tmp_path / "data" / "auth_token").exists()
