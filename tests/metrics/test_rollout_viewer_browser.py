"""The rollout viewer in a real, offline Chromium: from the dashboard to a run's rollouts (the run table's link,
the failures table's link), filtered by failure type, sorted, then one rollout: its trained tokens are the
mask's ones the trainer builds, its timeline shows the worker's spans, a gateway session's forks show as
branches with their reasons, and a record full of `<script>` and `<img onerror>` runs nothing.

With `ROLLOUT_BUFFER_SCREENSHOTS=<folder>` the pages' screenshots are copied there (how docs/rollouts.png and
docs/rollout.png were made).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx

from rollout_buffer.testing.engine import run_engine_in_thread
from slime_adapter.samples.token_path import build_token_pieces
from tests.support.browser import OfflineBrowser
from tests.support.fork_script import play
from tests.support.gateway import finish
from tests.support.helpers import ServerProcess
from tests.support.process_tools import wait_for
from tests.support.runtime_helpers import arithmetic_rows, start_native, write_rows
from tests.support.trajectories import tool_trajectory
from tests.support.viewer_pages import clean, keep_shot, loaded

# each trained token's logprob (from its title) and the opacity of its green
SHADES = """() => [...document.querySelectorAll("#turns .tok.trained")].map((node) => [
  Number((node.title.match(/logprob (-?[0-9.e-]+)/) || [0, "NaN"])[1]),
  Number(getComputedStyle(node).backgroundColor.match(/rgba?\\(([^)]*)\\)/)[1].split(",")[3] ?? 1)])"""
XSS = '<script>window.__pwned = "script"</script><img src=x onerror="window.__pwned = \'img\'">'


def stored(client: httpx.Client, run_id: str, **params: Any) -> list[dict[str, Any]]:
    return client.get(f"/runs/{run_id}/rollouts", params={"limit": 500, **params}).json()["rollouts"]


def test_from_the_dashboard_to_one_rollout_of_a_worker_run(tmp_path: Path, offline_browser: OfflineBrowser,
                                                            qwen_tokenizer_path: str) -> None:
    with run_engine_in_thread(template="qwen2.5", seed=5) as engine, ServerProcess(tmp_path / "data") as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        engine.configure(fail_next=2)
        run_id = start_native(client, write_rows(tmp_path, arithmetic_rows(4)), engine_url=engine.url,
                              tokenizer_path=qwen_tokenizer_path, repeats=2, num_process=2, engine_retries=0)
        wait_for(lambda: len(stored(client, run_id)) == 8, 60, "the run's 8 records stored")
        rows = stored(client, run_id)
        failed = [r["uid"] for r in rows if r["error_type"] == "EngineError"]
        assert len(failed) == 2
        # a leased read: the dashboard gets its reward histogram, and the records stay stored until an ack
        read = client.post("/get_rollout_data", json={"run_id": run_id, "lease_s": 120}).json()["data"]["data"]
        assert {r["uid"] for r in read} <= {r["uid"] for r in rows} and len(stored(client, run_id)) == 8

        visit = offline_browser.open(f"{server.url}/?run={run_id}&refresh=0", wait_for="body[data-updates]",
                                     wait_until="load")
        page = visit.page
        page.locator(f'#runs tr[data-run-id="{run_id}"] [data-testid="rollouts-link"]').click()  # click 1
        loaded(visit)
        assert page.locator("#rollouts tbody tr").count() == 8
        page.fill('[data-testid="filter-error-type"]', "EngineError")
        page.click('[data-testid="apply"]')
        loaded(visit, 2)
        shown = page.locator("#rollouts tbody tr")
        assert sorted(shown.nth(i).get_attribute("data-uid") or "" for i in range(shown.count())) == sorted(failed)
        assert "error_type=EngineError" in page.url, "the filter is in the page's URL"

        # the reward histogram's bins link to the rollouts in their reward range
        page.goto(f"{server.url}/?run={run_id}&refresh=0", wait_until="load")
        page.wait_for_selector('[data-testid="reward-bin-link"]')
        link = page.locator('[data-testid="reward-bin-link"]').last
        bin_count = int(link.inner_text().rsplit("(", 1)[1].rstrip(")"))
        href = link.get_attribute("href") or ""
        link.click()
        loaded(visit)
        low, high = (float(parse_qs(urlsplit(href).query)[k][0]) for k in ("reward_min", "reward_max"))
        # the bin counts the last read's samples by their rewards as stored (a group with an engine failure is not
        # handed over); the link
        # lists every stored rollout in the bin's range, failed ones included
        in_bin = [r for r in rows if r["reward"] is not None and low <= r["reward"] <= high]
        raw = [r["reward"] if r.get("raw_reward") is None else r["raw_reward"] for r in read]  # before normalizing
        assert bin_count == len([x for x in raw if low <= x <= high]) > 0, (raw, low, high)
        assert page.locator("#rollouts tbody tr").count() == len(in_bin) >= bin_count

        # the failures table links to the same rollouts
        page.goto(f"{server.url}/?run={run_id}&refresh=0", wait_until="load")
        page.wait_for_selector('#failures tr[data-error-type="EngineError"] a')
        page.click('#failures tr[data-error-type="EngineError"] [data-testid="failure-link"]')
        loaded(visit)
        assert page.locator("#rollouts tbody tr").count() == 2
        page.click('[id="clear"]')
        loaded(visit, 2)
        page.click('th[data-sort="reward"]')  # highest first
        loaded(visit, 3)
        rewards = [r["reward"] for r in stored(client, run_id, sort="-reward")]
        cells = page.locator("#rollouts tbody tr td:nth-child(4)")
        assert [float(cells.nth(i).inner_text()) for i in range(cells.count())] == [round(r, 3) for r in rewards]
        keep_shot(visit, "rollouts.png")

        done = next(r for r in rows if r["status"] == "completed" and r["turns"] > 0)
        page.click(f'#rollouts tr[data-uid="{done["uid"]}"] [data-testid="rollout-link"]')  # click 2
        loaded(visit)
        view = client.get(f"/runs/{run_id}/rollouts/{done['uid']}").json()
        assert view["turns"] and view["decoded"] is True, "the run's tokenizer shows tokens as text"
        [mine] = [r for r in read if r["uid"] == done["uid"]]
        mask_ones = sum(sum(p.loss_mask) for p in build_token_pieces(mine["turns"]).pieces)
        assert page.locator("#turns .tok.trained").count() == mask_ones == view["trained_tokens"] > 0
        names = [page.locator('[data-testid="timeline-span"]').nth(i).get_attribute("data-name")
                 for i in range(page.locator('[data-testid="timeline-span"]').count())]
        assert {"queued", "rollout", "engine_call", "written"} <= set(names), names
        assert names.count("engine_call") == len(mine["turns"])
        shades = page.evaluate(SHADES)  # darker (more opaque) green for a lower logprob
        assert len(shades) == mask_ones and len({lp for lp, _ in shades}) > 1
        ordered = [alpha for _, alpha in sorted(shades)]
        assert ordered == sorted(ordered, reverse=True), "the lower the logprob, the darker"
        assert page.locator('[data-testid="card-trained"] .value').inner_text().replace(",", "") == str(mask_ones)
        assert page.locator('[data-testid="message"]').count() == len(mine["messages"])
        keep_shot(visit, "rollout.png")
        clean(visit)


def test_a_gateway_session_with_forks_and_a_hostile_record(tmp_path: Path, offline_browser: OfflineBrowser,
                                                          rollout_engine: Any, qwen_tokenizer_path: str,
                                                          qwen_tokenizer: Any) -> None:
    with ServerProcess(tmp_path / "data") as server, httpx.Client(base_url=server.url, timeout=120) as client:
        run_id, session, _ = play(client, rollout_engine.url, qwen_tokenizer_path)
        finish(client, session, 1.0)
        hostile = tool_trajectory(qwen_tokenizer, "xss", 3, exact32=True)
        for message in hostile["messages"]:
            message["content"] = f"{message['content']} {XSS}"
        hostile["messages"][2]["tool_calls"][0]["function"]["arguments"] = f'{{"expression": "{XSS}"}}'
        hostile["messages"][2]["reasoning_content"] = XSS
        hostile["extra_info"] = {"verifier": {"exit_code": 1, "stdout_tail": XSS, XSS: XSS}, "error": XSS,
                                 "error_type": XSS}
        hostile["uid"] = f"{XSS}-uid"
        written = client.post("/buffer/write", json={**hostile, "run_id": run_id, "instance_id": XSS})
        assert written.json()["success"], written.text

        visit = offline_browser.open(f"{server.url}/rollouts?run={run_id}", wait_until="load")
        loaded(visit)
        page = visit.page
        assert page.locator("#rollouts tbody tr").count() == 2
        page.click(f'#rollouts tr[data-uid="{session["session_id"]}"] [data-testid="rollout-link"]')
        loaded(visit)
        view = client.get(f"/runs/{run_id}/rollouts/{session['session_id']}").json()
        assert len(view["turns"]) == page.locator('[data-testid="turn"]').count() == 11
        reasons = [page.locator('[data-testid="turn"]').nth(i).get_attribute("data-fork-reason") for i in range(11)]
        assert sorted(r for r in reasons if r) == sorted(["edited", "compacted", "tools_changed", "rewind"]
                                                         + ["foreign_assistant"] * 3)
        depths = [int(page.locator('[data-testid="turn"]').nth(i).get_attribute("data-depth") or 0) for i in range(11)]
        assert max(depths) >= 2, "turns continuing a branch sit below their parent"
        trained = sum(len(t["output_ids"]) for t in build_token_turns(client, run_id, session["session_id"]))
        assert page.locator("#turns .tok.trained").count() == view["trained_tokens"] == trained
        assert page.locator('[data-testid="timeline-span"][data-name="gateway_turn"]').count() == 11
        clean(visit)

        page.goto(f"{server.url}/rollout?{urlencode({'run': run_id, 'uid': hostile['uid']})}", wait_until="load")
        loaded(visit)
        assert page.evaluate("window.__pwned") is None, "nothing of the record ran"
        for box in ("#conversation", "#verifier", "#failure", "#extra", "#cards", "#turns"):
            assert page.locator(f"{box} img, {box} script").count() == 0, box
        conversation = page.locator("#conversation").inner_text()
        assert conversation.count("<script>") >= 4 and "onerror" in conversation, "shown as text"
        assert XSS in page.locator('[data-testid="tool-call"] pre').first.inner_text()
        assert XSS in page.locator("#failure").inner_text() and XSS in page.locator("#verifier").inner_text()
        assert page.locator("#uid").inner_text() == hostile["uid"]
        assert visit.outside_requests() == []


def build_token_turns(client: httpx.Client, run_id: str, uid: str) -> list[dict[str, Any]]:
    """The session record's turns as a reader gets them (a leased read, so the record stays stored)."""
    records = client.post("/get_rollout_data", json={"run_id": run_id, "lease_s": 60}).json()["data"]["data"]
    [record] = [r for r in records if r["uid"] == uid]
    return record["turns"]
