"""`rollout-buffer test-engine` as a newcomer meets it: every flag says what it does and its default,
`--template` offers every `test:<template>` tokenizer (qwen3.5 included, answering with its XML tool calls),
and a port in use is one clear line, not a traceback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx

from rollout_buffer.testing.engine import run_engine_in_thread
from rollout_buffer.testing.engine.cli import build_parser
from tests.support.helpers import REPO

ENGINE = [sys.executable, "-m", "rollout_buffer.cli", "test-engine"]
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def test_every_flag_has_help_and_its_default_is_shown() -> None:
    parser = build_parser()
    flags = [action for action in parser._actions if action.option_strings and action.dest != "help"]
    assert len(flags) >= 15
    assert [a.option_strings[0] for a in flags if not a.help] == [], "every flag says what it does"
    shown = subprocess.run([*ENGINE, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    for default in ("(default: 30000)", "(default: 127.0.0.1)", "(default: qwen2.5)", "(default: 0.5)"):
        assert default in text, text
    assert "qwen3.5" in text and "test:<template>" in text


def test_a_busy_port_is_one_clear_line() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([*ENGINE, "--port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"rollout-buffer test-engine: cannot listen on 127.0.0.1:{port}: Address already in use (choose another "
        "--port)"], done.stderr


def test_the_qwen35_template_answers_with_xml_tool_calls() -> None:
    assert "qwen3.5" in next(a for a in build_parser()._actions if a.dest == "template").choices
    messages = [{"role": "user", "content": "What is 3 * 7?"}]
    with run_engine_in_thread(template="qwen3.5", seed=1, noise_tokens=(0, 0)) as engine, \
            httpx.Client(base_url=engine.url, timeout=60) as client:
        first = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "tools": [CALCULATOR],
                                                          "return_token_ids": True})
        assert first.status_code == 200, first.text
        message = first.json()["choices"][0]["message"]
        [call] = message["tool_calls"]
        assert call["function"]["name"] == "calculator"
        assert json.loads(call["function"]["arguments"]) == {"expression": "3 * 7"}
        generated = engine.tokenizer.decode(engine.call_log()[-1]["output_ids"])
        assert "<function=calculator>\n<parameter=expression>\n3 * 7\n</parameter>" in generated, generated
        messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": "21"}]
        second = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "tools": [CALCULATOR]})
        assert second.status_code == 200, second.text
        assert "\\boxed{21}" in second.json()["choices"][0]["message"]["content"]
