"""Several hosts: two `serve` processes on loopback ports (standing in for hosts) on one Redis, behind a real
HAProxy (Debian's `haproxy`) running the configuration docs/scaling.md shows, with its addresses replaced by
loopback ports. A gateway session moves between the hosts mid-conversation, then one host stops and the
conversation carries on on the other; the record is token-exact either way."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import (CALCULATOR, assert_one_branch, assert_turns_are_engine_calls, calculate,
                                   engine_calls_of, finish, new_session, read_group, start_external)
from tests.support.helpers import REPO, ServerProcess, free_port
from tests.support.process_tools import wait_for

DOC = REPO / "docs" / "scaling.md"


def documented_config(frontend_port: int, hosts: list[int]) -> str:
    """The docs' HAProxy block, on loopback: the frontend on `frontend_port`, host N on `hosts[N-1]`."""
    [block] = re.findall(r"```haproxy\n(.*?)```", DOC.read_text(), re.DOTALL)
    config = block.replace("bind :8889", f"bind 127.0.0.1:{frontend_port}")
    for number, port in enumerate(hosts, start=1):
        config, count = re.subn(rf"server host{number} \S+", f"server host{number} 127.0.0.1:{port}", config)
        assert count == 1, f"the docs' config names host{number} once"
    return config


@pytest.fixture()
def haproxy_binary() -> str:
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
    assert found, "haproxy is not installed (Debian package `haproxy`; .ci/run installs it)"
    return found


@pytest.fixture()
def balancer(tmp_path: Path, haproxy_binary: str) -> Iterator[tuple[str, list[int], Path]]:
    """(frontend URL, the two host ports, config path), haproxy started on the config once hosts are up."""
    port, hosts = free_port(), [free_port(), free_port()]
    config = tmp_path / "haproxy.cfg"
    config.write_text(documented_config(port, hosts))
    check = subprocess.run([haproxy_binary, "-c", "-f", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    proc = subprocess.Popen([haproxy_binary, "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "haproxy.log", "wb"))
    try:
        yield f"http://127.0.0.1:{port}", hosts, tmp_path / "haproxy.log"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_session_moves_between_hosts_behind_haproxy(tmp_path: Path, rollout_engine: Any, qwen_tokenizer_path: str,
                                                     external_redis: str,
                                                     balancer: tuple[str, list[int], Path]) -> None:
    url, ports, _log = balancer
    hosts = []
    for name, port in zip(("host1", "host2"), ports, strict=True):
        host = ServerProcess(tmp_path / name, "--redis-url", external_redis, "--workers", "0")
        host.port = port
        hosts.append(host.start())
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            wait_for(lambda: {client.get("/health").headers.get("x-served-by") for _ in range(4)} == {"host1", "host2"},
                     60, "haproxy sees both hosts up")
            run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=1)
            session = new_session(client, run_id, "between-hosts")
            sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=session["api_key"], max_retries=0)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7?"}]
            served = []
            for turn in range(4):
                if turn == 2:  # the host that served the last turn goes away mid-conversation
                    gone = hosts[["host1", "host2"].index(served[-1])]
                    gone.stop()
                raw = sdk.chat.completions.with_raw_response.create(model="m", messages=messages, tools=[CALCULATOR])
                served.append(raw.headers.get("x-served-by"))
                message = raw.parse().choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                for call in message.tool_calls or []:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": calculate(call.function.arguments)})
                if not message.tool_calls:
                    messages.append({"role": "user", "content": f"Now add {turn + 2}."})
            assert served[0] != served[1], f"the first two turns went to different hosts: {served}"
            assert served[2] == served[3] != served[1], f"the last two turns went to the host left: {served}"
            finish(client, session, 1.0)
            [record] = read_group(client, run_id, 1)
    finally:
        for host in hosts:
            host.stop()
    assert len(record["turns"]) == 4
    assert_turns_are_engine_calls(record, engine_calls_of(rollout_engine, session["session_id"]))
    assert_one_branch(record)
