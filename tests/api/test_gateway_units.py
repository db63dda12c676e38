"""Gateway units: canonical messages (what two spellings of one message share), prefix digests, and a
session turn's storage (prompt tails resolved back to full prompts)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from rollout_buffer.api.gateway import history
from rollout_buffer.store.session_turns import Node, resolve

CALL = {"id": "call_0_0", "type": "function", "function": {"name": "calc", "arguments": '{"a": 1, "b": [2, 3]}'}}


def test_spellings_of_one_message_are_one_canonical_form() -> None:
    ours = {"role": "assistant", "content": "ok", "reasoning_content": "thinking", "tool_calls": [CALL]}
    echoed = {"role": "assistant", "content": [{"type": "text", "text": "o"}, {"type": "text", "text": "k"}],
              "tool_calls": [{"id": "other", "type": "function",
                              "function": {"name": "calc", "arguments": '{"b":[2,3],"a":1}'}}]}
    assert history.canonical(ours) == history.canonical(echoed)
    assert history.canonical({"role": "user", "content": None}) == history.canonical({"role": "user", "content": ""})
    assert history.canonical({"role": "user", "content": "x"}) == history.canonical(
        {"role": "user", "content": [{"type": "text", "text": "x"}]})
    different = [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok!"},
                 {**ours, "tool_calls": [{**CALL, "function": {"name": "calc", "arguments": '{"a": 2}'}}]},
                 {**ours, "tool_calls": []}]
    assert len({history.canonical(m) for m in [ours, *different]}) == 5


def test_prefix_digests_name_each_history_and_its_tools() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    digests = history.prefix_digests(None, messages)
    assert len(digests) == 4 and len(set(digests)) == 4
    assert history.prefix_digests(None, messages[:2]) == digests[:3]
    assert history.prefix_digests([{"type": "function", "function": {"name": "f"}}], messages)[0] != digests[0]
    assert history.extend(digests[2], messages[2]) == digests[3]
    assert history.request_digest(digests[3], {"t": 1}) != history.request_digest(digests[3], {"t": 0})


def _node(index: int, parent: int, prompt: list[int], output: list[int], chain: list[int], base: int) -> Node:
    return Node(index=index, parent=parent, new_messages=[], message={"role": "assistant", "content": ""},
                prompt_ids=np.asarray(prompt, dtype=np.int32), output_ids=np.asarray(output, dtype=np.int32),
                output_logprobs=-np.ones(len(output)), finish_reason="stop", chain=chain, base=base)


def test_turns_store_only_their_tails_and_resolve_to_full_prompts() -> None:
    root = _node(0, -1, [1, 2, 3], [4, 5], [], 0)
    child = _node(1, 0, [1, 2, 3, 4, 5, 6], [7], [0], 5)
    branch = _node(2, 0, [1, 2, 3, 4, 5, 8, 9], [10, 11], [0], 5)
    grandchild = _node(3, 1, [1, 2, 3, 4, 5, 6, 7, 12], [13], [0, 1], 7)
    stored = {n.index: Node.unpack(n.pack()) for n in (root, child, branch, grandchild)}
    assert len(child.pack()) < len(_node(1, -1, child.prompt_ids.tolist(), [7], [], 0).pack())
    assert [n.resolved for n in stored.values()] == [True, False, False, False]
    resolve(stored)
    for original in (root, child, branch, grandchild):
        again = stored[original.index]
        assert again.prompt_ids.tolist() == original.prompt_ids.tolist()
        assert again.output_ids.tolist() == original.output_ids.tolist()
        assert again.output_logprobs.tolist() == original.output_logprobs.tolist()
        assert again.turn()["finish_reason"] == "stop"


def test_a_small_render_runs_on_the_loop_and_a_large_one_in_the_render_thread() -> None:
    """A turn's few new messages are rendered where the turn runs (a thread hop costs more than the render);
    a long conversation goes to the render thread, so the event loop keeps answering meanwhile."""
    from rollout_buffer.api.gateway.rendering import INLINE_CHARS, TOOL_CHARS, render_sized

    def where() -> np.ndarray:
        return np.asarray([threading.get_ident()])

    async def main() -> tuple[int, int, int, int]:
        small = [{"role": "user", "content": "x" * 100}]
        large = [{"role": "user", "content": "x" * (INLINE_CHARS + 1)}]
        tools = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(INLINE_CHARS // TOOL_CHARS + 1)]
        return (int((await render_sized(where, small, None))[0]), int((await render_sized(where, large, None))[0]),
                int((await render_sized(where, small, tools))[0]), threading.get_ident())

    small, large, many_tools, loop_thread = asyncio.run(main())
    assert small == loop_thread and large != loop_thread and many_tools != loop_thread
