"""Verifiers, each run against a real local sandbox: exact answers, tests that pass, a command's last line,
a Python callable; every way a verifier can fail is a VerifierError (counted by the task, never fatal)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_buffer.agents.local import LocalSandbox
from rollout_buffer.agents.sandbox import Limits
from rollout_buffer.agents.verifiers import (
    AgentResult,
    VerifierError,
    extract_answer,
    final_text,
    run_verifier,
    same_answer,
    verifier_from,
)


def _result(stdout: str) -> AgentResult:
    return AgentResult(exit_code=0, stdout=stdout, stderr="", timed_out=False, duration_s=0.1,
                       final_text=final_text(stdout))


@pytest.fixture()
async def box(tmp_path: Path):  # type: ignore[no-untyped-def]
    sandbox = LocalSandbox(name="verify", limits=Limits(), options={"root": str(tmp_path)})
    yield sandbox
    await sandbox.cleanup()


def test_answers_are_read_from_the_final_text() -> None:
    claude = json.dumps({"type": "result", "result": "Thinking... The answer is \\boxed{137}", "num_turns": 2})
    assert final_text("log line\n" + claude + "\n") == "Thinking... The answer is \\boxed{137}"
    assert extract_answer("a \\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_answer("it is 41, no, 42.") == "42" and extract_answer("no idea") is None
    assert same_answer("42.0", 42) and same_answer("1/2", "0.5") and same_answer(" x ", "x")
    assert not same_answer("41", "42") and not same_answer(None, "42") and not same_answer("x", "y")


async def test_exact_answer(box: LocalSandbox) -> None:
    verify = verifier_from(None)
    right = await run_verifier(verify, box, {"label": "137"}, _result('{"result": "so \\\\boxed{137}"}'))
    wrong = await run_verifier(verify, box, {"label": "137"}, _result("I think 136"))
    assert right == {"reward": 1.0, "answer": "137"} and wrong == {"reward": 0.0, "answer": "136"}


async def test_tests_pass(box: LocalSandbox) -> None:
    await box.write_file("solution.py", "def add(a, b):\n    return a + b\n")
    await box.write_file("check.py", "from solution import add\nassert add(2, 3) == 5\n")
    verify = verifier_from({"type": "tests_pass", "command": "python3 check.py", "timeout_s": 30})
    assert (await run_verifier(verify, box, {}, _result("")))["reward"] == 1.0
    await box.write_file("solution.py", "def add(a, b):\n    return a - b - 1\n")
    failed = await run_verifier(verify, box, {}, _result(""))
    assert failed["reward"] == 0.0 and failed["exit_code"] == 1 and "AssertionError" in failed["stderr_tail"]


async def test_command_verifier(box: LocalSandbox) -> None:
    number = verifier_from({"type": "command", "command": "echo checking; echo 0.25"})
    assert (await run_verifier(number, box, {}, _result("")))["reward"] == 0.25
    rich = verifier_from({"type": "command", "command": "echo '{\"reward\": 1, \"passed\": 3}'"})
    verdict = await run_verifier(rich, box, {}, _result(""))
    assert verdict["reward"] == 1.0 and verdict["passed"] == 3
    for command, reason in (("echo 1; exit 3", "exit 3"), ("echo not-a-number", "not a number"),
                            ("true", "no reward line"), ("echo '\"text\"'", "not a finite number"),
                            ("sleep 5", "timed out True")):
        bad = verifier_from({"type": "command", "command": command, "timeout_s": 1})
        with pytest.raises(VerifierError, match=reason):
            await run_verifier(bad, box, {}, _result(""))


async def test_python_verifier(box: LocalSandbox) -> None:
    verify = verifier_from({"type": "python", "callable": "tests.support.agent_verifiers:length_reward"})
    assert await run_verifier(verify, box, {"label": "abc"}, _result("abcd")) == {"reward": 0.75}
    broken = verifier_from({"type": "python", "callable": "tests.support.agent_verifiers:broken"})
    with pytest.raises(VerifierError, match="ZeroDivisionError"):
        await run_verifier(broken, box, {}, _result(""))


def test_bad_verifier_options_are_named() -> None:
    for spec, reason in (("exact", "must be an object"), ({"type": "magic"}, "unknown verifier type"),
                         ({"type": "tests_pass"}, "needs 'command'"),
                         ({"type": "command", "command": "x", "timeout_s": 0}, "timeout_s"),
                         ({"type": "python"}, "needs 'callable'"),
                         ({"type": "python", "callable": "tests.support.agent_verifiers:nothing"}, "not a callable")):
        with pytest.raises(ValueError, match=reason):
            verifier_from(spec)
