"""The dashboard shows an external run's gateway sessions: open sessions, turns, turns/s and forks by
reason, in a real offline Chromium."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai

from tests.support.browser import OfflineBrowser
from tests.support.gateway import CALCULATOR, new_session, openai_tool_loop, start_external
from tests.support.helpers import ServerProcess
from tests.support.process_tools import wait_for


def test_the_dashboard_shows_sessions_turns_and_forks(tmp_path: Path, offline_browser: OfflineBrowser,
                                                      rollout_engine: Any, qwen_tokenizer_path: str) -> None:
    with ServerProcess(tmp_path / "data", env={"ROLLOUT_BUFFER_TIMELINE_INTERVAL_S": "0.2"}) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        run_id = start_external(client, rollout_engine.url, qwen_tokenizer_path, repeats=2)
        session = new_session(client, run_id, "dash")
        sdk = openai.OpenAI(base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0)
        history = openai_tool_loop(sdk, ["What is 6 * 7?"])
        history[0]["content"] = "What is 6 * 8?"
        sdk.chat.completions.create(model="m", messages=[*history, {"role": "user", "content": "And 1 + 1?"}],
                                    tools=[CALCULATOR])
        wait_for(lambda: client.get("/api/dashboard", params={"run_id": run_id}).json()["run"]["gateway"][
            "turns_per_s"] is not None, 15, "a turns/s sample")
        visit = offline_browser.open(f"{server.url}/?run={run_id}&refresh=0", wait_for="#gateway tbody tr",
                                     wait_until="load")
        rows = dict(tuple(cell.strip() for cell in line.split("\t"))
                    for line in visit.page.locator("#gateway tbody").inner_text().strip().splitlines())
    assert rows["sessions open"] == "1" and rows["turns"] == "3" and rows["forks"] == "1", rows
    assert rows["forks: edited"] == "1" and rows["turns/s"] not in ("", "–"), rows
    assert visit.outside_requests() == [] and visit.page_errors == []
