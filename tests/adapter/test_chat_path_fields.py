"""The chat-completions engine path (`engine_api: "chat"`) keeps each engine call's meta fields as the
`/generate` path does (`calls`: the engine's `weight_version`, `prompt_tokens`, `cached_tokens`, `spec_*`),
so Samples built from its records (messages re-tokenized) carry slime's `weight_versions`,
`prefix_cache_info` and `spec_info` too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from slime_adapter.samples.build import build_samples
from tests.adapter.test_slime_fields import GROUP, replay_engine  # noqa: F401
from tests.support.helpers import ServerProcess, write_jsonl
from tests.support.runtime_helpers import drain, start_native


def test_chat_path_records_keep_every_calls_meta(runtime_server: ServerProcess, replay_engine: Any,
                                                 qwen_tokenizer: Any, tmp_path: Path) -> None:
    rows = [{"instance_id": f"c{i}", "prompt": f"Compute {i} * 7 with the tool.", "turns": 2} for i in range(2)]
    with httpx.Client(base_url=runtime_server.url, timeout=30) as client:
        run_id = start_native(client, write_jsonl(tmp_path / "c.jsonl", rows), engine_url=replay_engine.url,
                              tokenizer_path="", task_type="slime_fields", repeats=GROUP, engine_api="chat")
        records = drain(client, run_id, 2 * GROUP)
    for record in records:
        assert record.get("turns") is None, "the chat path records no token ids"
        calls = record["calls"]
        assert len(calls) == 2 and all(c["weight_version"] == "v7" for c in calls), "one entry per engine call"
        assert all(c["prompt_tokens"] > 0 and c["completion_tokens"] > 0 for c in calls)
        assert calls[1]["cached_tokens"] > 0, "the second call's prompt extends the first: a prefix cache hit"
        assert all(c["spec_draft_token_num"] == 3 * c["spec_verify_ct"] for c in calls)
        [sample], _ = build_samples(record, lambda: qwen_tokenizer)
        assert sample.metadata["mask_source"] != "tokens"
        assert sample.weight_versions == ["v7", "v7"], "the engine's own string, once per call, as slime appends"
        assert sample.prefix_cache_info.to_dict() == {
            "cached_tokens": sum(c["cached_tokens"] for c in calls),
            "total_prompt_tokens": sum(c["prompt_tokens"] for c in calls)}
        assert sample.spec_info.to_dict() == {
            "spec_accept_token_num": sum(c["spec_accept_token_num"] for c in calls),
            "spec_draft_token_num": sum(c["spec_draft_token_num"] for c in calls),
            "spec_verify_ct": sum(c["spec_verify_ct"] for c in calls),
            "completion_token_num": sum(c["completion_tokens"] for c in calls)}
