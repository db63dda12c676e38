"""`rollout-buffer tasks check DIR`: every task parsed, images found or built, reference solutions run through
the task's own verifier under the safest verify mode in which it scores 1 (the MODE column); a warning for tests
that run the work folder's code as root; a failing exit status when any task is broken."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.docker_env import DockerEnv, docker_env  # noqa: F401 - the session fixture
from tests.support.harbor_tasks import add_broken_build, make_dataset

pytestmark = pytest.mark.timeout(600)


def _check(*args: str, env_url: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    if env_url:
        env["DOCKER_HOST"] = env_url
    return subprocess.run([sys.executable, "-m", "rollout_buffer.cli", "tasks", "check", *args], env=env,
                          capture_output=True, text=True, timeout=500)


def _rows(out: str) -> dict[str, str]:
    """The table's lines by task (the lines before the blank line that starts the problems and warnings)."""
    table = out.split("\n\n", 1)[0]
    return {line.split()[0]: line for line in table.splitlines() if line and not line[0].isdigit()}


def test_reference_solutions_score_one_and_broken_tasks_are_named(tmp_path: Path,
                                                                   docker_env: DockerEnv) -> None:  # noqa: F811
    dataset = make_dataset(tmp_path / "tasks", docker_env.image)
    clean = _check(str(dataset), env_url=None)  # parse only: no Engine needed
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "4/4 tasks ok" in clean.stdout
    add_broken_build(dataset)
    # partial's solution reads [environment.env] and [solution.env]: it scores 1 only with both in its environment
    toml, solve = dataset / "partial" / "task.toml", dataset / "partial" / "solution" / "solve.sh"
    toml.write_text(toml.read_text().replace("[environment]\n", '[environment]\nenv = { FIRST = "4" }\n')
                    + '\n[solution]\nenv = { SECOND = "${RB_TEST_NO_SUCH_VARIABLE:-6}" }\n')
    solve.write_text(solve.read_text().replace("printf '4\\n6\\n'", 'printf "$FIRST\\n$SECOND\\n"'))
    assert '"$FIRST' in solve.read_text()
    # a task whose tests read what the solution left outside the work folder: it scores 1 under snapshot only
    shutil.copytree(dataset / "hello", dataset / "outside")
    (dataset / "outside" / "solution" / "solve.sh").write_text("#!/bin/bash\necho hello > /var/tmp/hello.txt\n")
    (dataset / "outside" / "tests" / "test.sh").write_text(
        "#!/bin/bash\nif [ \"$(cat /var/tmp/hello.txt)\" = hello ]; then echo 1; else echo 0; fi"
        " > /logs/verifier/reward.txt\n")
    # a task that needs root (Harbor's agent user, the default here too): its solution writes /etc and chowns
    shutil.copytree(dataset / "hello", dataset / "needs-root")
    (dataset / "needs-root" / "solution" / "solve.sh").write_text(
        "#!/bin/bash\necho hello > /etc/rb-hello && chown nobody /etc/rb-hello\n")
    (dataset / "needs-root" / "tests" / "test.sh").write_text(
        "#!/bin/bash\nif [ \"$(stat -c %U /etc/rb-hello)\" = nobody ]; then echo 1; else echo 0; fi"
        " > /logs/verifier/reward.txt\n")
    # a task whose tests run a work-folder script that imports its sibling (Terminal-Bench 2's cancel-async-tasks
    # does): it scores 1 only with Harbor's own sys.path, which the check says, with the option that gives it
    shutil.copytree(dataset / "hello", dataset / "sibling")
    (dataset / "sibling" / "solution" / "solve.sh").write_text("#!/bin/bash\necho 'ANSWER = 42' > /app/answer.py\n")
    (dataset / "sibling" / "tests" / "driver.py").write_text("import answer\nassert answer.ANSWER == 42\n")
    (dataset / "sibling" / "tests" / "test.sh").write_text(
        "#!/bin/bash\ncp /tests/driver.py /app/ && cd /app && if python3 driver.py; then echo 1; else echo 0; fi"
        " > /logs/verifier/reward.txt\n")
    toml = dataset / "hello" / "task.toml"
    toml.write_text(toml.read_text().replace("timeout_sec = 60.0", "timeout_sec = -1"))
    done = _check(str(dataset), "--solutions", "--docker-host", docker_env.url, env_url=None)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert rows["TASK"].split() == ["TASK", "PARSE", "IMAGE", "USER", "SOLUTION", "MODE", "OK"]
    assert " root " in rows["fix-bug"] and rows["needs-root"].split()[-2:] == ["snapshot", "yes"]
    assert "reward 1" in rows["fix-bug"] and "rollout-buffer-harbor/fix-bug:" in rows["fix-bug"]
    assert rows["fix-bug"].split()[-2:] == ["clean", "yes"] and rows["partial"].split()[-2:] == ["clean", "yes"]
    assert "reward 1" in rows["outside"] and rows["outside"].split()[-2:] == ["snapshot", "yes"]
    assert "reward 1" in rows["sibling"] and rows["sibling"].split()[-2:] == ["clean/no-safe-path", "yes"]
    assert "sibling: warning: solution: scores 1 only with Harbor's sys.path (no PYTHONSAFEPATH)" in done.stdout
    assert 'agent.verify.python_safe_path {"sibling": false}' in done.stdout
    # fix-bug's test imports the agent's calc.py from /app as root: warned about, naming the file
    assert "fix-bug: warning: tests/: its tests run code from the work folder as root: puts /app on sys.path " \
           "(test_calc.py)" in done.stdout
    assert "hello: warning: tests/" not in done.stdout
    assert rows["fix-bug"].endswith("yes") and rows["partial"].endswith("yes") and "reward 1" in rows["partial"]
    assert "1 problem(s)" in rows["hello"] and rows["hello"].endswith("NO")
    assert rows["broken-build"].endswith("NO") and rows["no-reward"].endswith("NO")
    lines = done.stdout.splitlines()
    assert "hello: problem: task.toml [verifier] timeout_sec: must be a number > 0, got -1" in lines
    build = next(line for line in lines if line.startswith("broken-build: problem: image: "))
    assert "build failed" in build and len(build) > 150 and "last output" in build  # never cut at 100
    assert any(line.startswith("no-reward: problem: solution: error: ") and "wrote no reward" in line
               for line in lines), done.stdout
    assert "5/8 tasks ok" in done.stdout


def test_every_problem_of_every_task_at_once_untruncated_and_as_json(tmp_path: Path) -> None:
    """No Engine: a parse-only check lists each task's every problem and warning, in text and in JSON."""
    dataset = make_dataset(tmp_path / "tasks", "base:1")
    host = tmp_path / "host-secret.txt"
    host.write_text("host-only-ocelot-5501\n")
    (dataset / "hello" / "instruction.md").unlink()
    (dataset / "hello" / "instruction.md").symlink_to(host)
    toml = dataset / "hello" / "task.toml"
    toml.write_text(toml.read_text().replace("memory_mb = 512", "memory_mb = inf\ncpu = 1")
                    .replace("cpus = 1", "cpus = 100000"))
    long_reason = "x" * 300
    toml = dataset / "partial" / "task.toml"
    toml.write_text(toml.read_text().replace("[verifier]", f'[verifier]\nuser = "{long_reason}"'))
    (dataset / "no-reward" / "tests" / "test.sh").unlink()
    (dataset / "outside").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "task.toml").write_text("")
    text = _check(str(dataset), env_url=None)
    assert text.returncode == 1, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    for expected in ("hello: problem: instruction.md: is a link to", "hello: problem: task.toml [environment] cpus: "
                     "must be at most", "hello: problem: task.toml [environment] memory_mb: must be a finite number",
                     "hello: warning: task.toml [environment] cpu: unknown key", "no-reward: problem: tests/test.sh: "
                     "missing", "outside: problem: folder: is a link to", f"partial: warning: task.toml [verifier] "
                     f"user: '{long_reason}' is not honoured"):
        assert any(line.startswith(expected) for line in lines), (expected, text.stdout)
    assert "host-only-ocelot-5501" not in text.stdout and "2/5 tasks ok" in text.stdout
    as_json = _check(str(dataset), "--json", env_url=None)
    assert as_json.returncode == 1
    report = json.loads(as_json.stdout)
    assert (report["ok"], report["total"]) == (2, 5)
    tasks = {row["task"]: row for row in report["tasks"]}
    assert [p["field"] for p in tasks["hello"]["problems"]] == [
        "instruction.md", "task.toml [environment] cpus", "task.toml [environment] memory_mb"]
    assert tasks["hello"]["warnings"] == [{"field": "task.toml [environment] cpu", "message": "unknown key, "
                                           "ignored as Harbor ignores it (did you mean 'cpus'?)"}]
    assert tasks["partial"]["ok"] and tasks["partial"]["warnings"][0]["message"].startswith(f"'{long_reason}'")
    assert tasks["fix-bug"] == {"task": "fix-bug", "parsed": "ok", "image": "-", "user": "USER|root",
                                "solution": "-", "mode": "-", "ok": True, "problems": [], "warnings": [], "pulls": []}
    # who the agent runs as: the run's --user, else the task's [agent] user (else the image's USER, else root)
    toml = dataset / "fix-bug" / "task.toml"
    toml.write_text(toml.read_text() + '\n[agent]\nuser = "builder"\n' if "[agent]" not in toml.read_text()
                    else toml.read_text().replace("[agent]", '[agent]\nuser = "builder"'))
    users = {row["task"]: row["user"] for row in json.loads(_check(str(dataset), "--json", env_url=None).stdout)["tasks"]}
    assert users["fix-bug"] == "builder" and users["partial"] == "USER|root"
    users = {row["task"]: row["user"] for row in json.loads(_check(str(dataset), "--json", "--user", "1000:1000",
                                                                   env_url=None).stdout)["tasks"]}
    assert users["fix-bug"] == users["partial"] == "1000:1000"
