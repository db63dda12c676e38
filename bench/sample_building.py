"""Sample building throughput: the message path against slime's own algorithm, and the token path against
the message path, on the same conversations.

Trajectories are 4-turn tool-use conversations (three calculator calls, then an answer) with real token
turns, made by rendering each engine call's prompt with the real Qwen2.5 tokenizer, as a worker records
them. Every record is a different conversation (no two share a prompt), so nothing this project caches per
prompt helps; the run also times the message path with its block cache switched off.

* message path: `build_samples` on records without `turns` (one render + one tokenization with offsets,
  checked by the generator's "cheap" invariants);
* baseline (what a skeptic would pick): slime's `MultiTurnLossMaskGenerator` algorithm for `qwen`, written
  here from its description: each message rendered and tokenized on its own (the first with the tools),
  after the same per-call `get_added_vocab()` check for a distilled tokenizer that slime's `get_loss_mask` makes,
  the default system prompt's tokens cut off every later message, and an assistant message masked 1
  after its generation-prompt header. Its tokens must equal the message path's token for token (the run
  fails otherwise); its mask also covers the newline after each `<|im_end|>`, which the model never
  generates, so masks are compared and the difference reported;
* token path: `build_samples` on the same records with `turns` (the engine's own ids, no tokenizer): what a
  user gains by recording turns, against the message path. The records come as the adapter reads them by
  default, a packed read (turns as arrays), its decoding timed with the building; the same records read as
  JSON (`agent_read_format json`: turns as lists, validated by the record model), parsing timed alike, are
  timed too, and must give the same samples.

Rates are samples per CPU second of the building process (single-threaded work; see `_rate`); every side
runs in 3 rounds, the order reversed every other round, and each side's best round counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from collections.abc import Callable
from typing import Any

import orjson

from rollout_buffer.testing.tokenizer import load_qwen_tokenizer
from rollout_buffer.wire.packed_read import decode, encode_answer
from rollout_buffer.wire.schema import TrajectoryRecord
from slime_adapter.masks.loss_mask import cached_loss_mask_generator
from slime_adapter.samples.build import build_samples

__all__ = ["GROUP", "PerMessageBaseline", "main", "make_trajectories", "run"]

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]
GROUP = 8  # records per instance id (n_samples_per_prompt)
ROUNDS = 3


def _conversation(rng: random.Random) -> list[dict[str, Any]]:
    """System, question, three calculator calls with their results, final answer: 4 assistant turns."""
    a, b, c, d = (rng.randint(2, 999) for _ in range(4))
    steps = [f"{a} * {b}", f"{a * b} + {c}", f"{a * b + c} - {d}"]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant. Use the calculator for arithmetic."},
        {"role": "user", "content": f"A shop sells {a} boxes of {b} pens, gets {c} more pens and gives away {d}. "
                                    "How many pens are left? Show the steps."},
    ]
    for i, expr in enumerate(steps):
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}
        messages.append({"role": "assistant", "content": f"Step {i + 1}: I need {expr}.", "tool_calls": [call]})
        messages.append({"role": "tool", "content": str(eval(expr))})
    messages.append({"role": "assistant", "content": f"The shop has {a * b + c - d} pens left. "
                                                     f"\\boxed{{{a * b + c - d}}}"})
    return messages


def _ids(tok: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    return list(tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=False,
                                        add_generation_prompt=generation_prompt))


def _turns(tok: Any, messages: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """One engine call per assistant message: the rendered prompt, and the sampled ids through <|im_end|>."""
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    turns = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _ids(tok, messages[:k], True)
        full = _ids(tok, messages[:k + 1], False)
        assert full[:len(prompt)] == prompt, "the rendering of a longer conversation extends the prompt"
        tail = full[len(prompt):]
        output = tail[:tail.index(end_id) + 1]
        turns.append({"prompt_ids": prompt, "output_ids": output, "finish_reason": "stop", "weight_version": "1",
                      "output_logprobs": [-rng.random() for _ in output]})
    return turns


def make_trajectories(n: int, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`n` records with `turns` and the same `n` without; every record is a distinct conversation."""
    tok = load_qwen_tokenizer("qwen2.5")
    rng = random.Random(seed)
    with_turns, without = [], []
    seen: set[str] = set()
    for i in range(n):
        messages = _conversation(rng)
        while messages[1]["content"] in seen:
            messages = _conversation(rng)
        seen.add(messages[1]["content"])
        base = {"uid": f"u{i}", "instance_id": str(i // GROUP), "messages": messages, "tools": TOOLS,
                "reward": float(i % 2), "extra_info": {}}
        with_turns.append({**base, "turns": _turns(tok, messages, rng)})
        without.append(base)
    return with_turns, without


class PerMessageBaseline:
    """slime's per-message loss mask for Qwen2.5 ChatML, from its description (see the module docstring)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        probe = [{"role": "user", "content": "probe"}]
        alone = self._render([probe[0]], None)
        text = tok.apply_chat_template(probe, tokenize=False)
        # the default system block the template puts before a lone non-system message
        self.system_len = len(tok(text[:text.index("<|im_start|>user")], add_special_tokens=False)["input_ids"])
        with_header = tok.apply_chat_template(probe, tokenize=True, return_dict=False, add_generation_prompt=True)
        self.header_len = len(with_header) - len(alone)  # "<|im_start|>assistant\n": never generated

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return list(self.tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False))

    def prompt_response(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                        ) -> tuple[list[int], list[int], list[int]]:
        if "<｜Assistant｜>" in self.tok.get_added_vocab():  # slime's per-call check for a distilled tokenizer
            raise ValueError("the per-message baseline is for ChatML tokenizers")
        ids: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            piece = self._render([message], tools if i == 0 else None)
            if i > 0 and message["role"] != "system":
                piece = piece[self.system_len:]
            trained = len(piece) - self.header_len if message["role"] == "assistant" else 0
            ids.extend(piece)
            mask.extend([0] * (len(piece) - trained) + [1] * trained)
        split = mask.index(1)
        return ids[:split], ids[split:], mask[split:]


def _read_packed(answer: bytes) -> list[dict[str, Any]]:
    """The records of a packed read answer, as the adapter decodes them by default (turns as arrays)."""
    return decode(answer)["data"]["data"]


def _rate(n: int, build: Callable[[], list[Any]]) -> tuple[float, list[Any]]:
    """Samples per CPU second of this process: building is single-threaded CPU work, and CPU time is what
    it costs the trainer; unlike wall time it does not depend on what else the machine runs."""
    began = time.process_time()
    out = build()
    return n / (time.process_time() - began), out


def run(quick: bool = False) -> dict[str, Any]:
    """Build 1024 samples (256 when `quick`) each way; returns rates, ratios and the identity checks."""
    n = 256 if quick else 1024
    tok = load_qwen_tokenizer("qwen2.5")
    getter = lambda: tok
    with_turns, without = make_trajectories(n)
    baseline = PerMessageBaseline(tok)
    warm = make_trajectories(2, seed=99)[1]  # warm tokenizer, template and generator caches for every builder
    build_samples(warm[0], getter, "qwen")
    baseline.prompt_response(warm[1]["messages"], warm[1]["tools"])
    generator = cached_loss_mask_generator("qwen", tok)
    generator.clear_block_cache()

    def uncached() -> list[Any]:
        cache_size, generator.block_cache_size = generator.block_cache_size, 0
        try:
            return [build_samples(r, getter, "qwen")[0][0] for r in without]
        finally:
            generator.block_cache_size = cache_size

    def cached() -> list[Any]:
        generator.clear_block_cache()  # cold at the start of every round: the conversations are all distinct
        return [build_samples(r, getter, "qwen")[0][0] for r in without]

    sides: dict[str, Callable[[], list[Any]]] = {
        "message": cached, "uncached": uncached,
        "baseline": lambda: [baseline.prompt_response(r["messages"], r["tools"]) for r in without],
        "token": lambda: [build_samples(r, getter, "qwen")[0][0] for r in _read_packed(packed_answer)],
        "token_json": lambda: [build_samples(r, getter, "qwen")[0][0]
                               for r in orjson.loads(json_answer)["data"]["data"]],
        # the part of the token path that is the record model's validation of a JSON read (what a packed read
        # skips): timed alone, so the row can say what limits it
        "validation": lambda: [TrajectoryRecord.model_validate(r) for r in with_turns]}
    packed_answer = encode_answer({"success": True, "data": {"data": with_turns}})
    json_answer = orjson.dumps({"success": True, "data": {"data": with_turns}})
    # the inputs (2 x 1024 trajectories, millions of list items) out of the collector's view: a trainer does not
    # hold them, and the collections they made costly fell on whichever side happened to trigger one
    gc.collect()
    gc.freeze()
    rates: dict[str, list[float]] = {side: [] for side in sides}
    out: dict[str, list[Any]] = {}
    for round_ in range(ROUNDS):  # every side once per round, the order reversed every other round; each
        for side in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:  # side's best round counts
            rate, out[side] = _rate(n, sides[side])
            rates[side].append(rate)
    gc.unfreeze()
    message_rate, uncached_rate, baseline_rate, token_rate, token_json_rate, validation_rate = (
        max(rates[side]) for side in sides)
    message_samples, uncached_samples, reference, token_samples, token_json_samples, _ = (out[side] for side in sides)

    mask_diff = 0
    for sample, uncached, (prompt, response, mask) in zip(message_samples, uncached_samples, reference):
        if sample.tokens != prompt + response:
            raise AssertionError(f"message path and the per-message baseline differ for {sample.metadata['uid']}")
        if uncached.tokens != sample.tokens or uncached.loss_mask != sample.loss_mask:
            raise AssertionError(f"the block cache changed the sample of {sample.metadata['uid']}")
        mask_diff += sum(a != b for a, b in zip(sample.loss_mask, mask))
    for packed_sample, json_sample in zip(token_samples, token_json_samples):
        if (packed_sample.tokens, packed_sample.loss_mask, packed_sample.rollout_log_probs) != (
                json_sample.tokens, json_sample.loss_mask, json_sample.rollout_log_probs):
            raise AssertionError(f"the packed and JSON reads built different samples for {packed_sample.metadata['uid']}")
    for tokens_sample, message_sample in zip(token_samples, message_samples):
        assert tokens_sample.metadata["mask_source"] == "tokens" and "fork" not in tokens_sample.metadata
        assert sum(tokens_sample.loss_mask) == sum(message_sample.loss_mask), "both mask the same generated ids"
    return {
        "samples": n,
        "assistant_turns": 4,
        "distinct_conversations": n,
        "message_per_s": round(message_rate, 1),
        "message_no_cache_per_s": round(uncached_rate, 1),
        "per_message_baseline_per_s": round(baseline_rate, 1),
        "token_per_s": round(token_rate, 1),
        "message_ratio": round(message_rate / baseline_rate, 2),
        "message_no_cache_ratio": round(uncached_rate / baseline_rate, 2),
        "token_ratio": round(token_rate / message_rate, 2),
        "token_json_per_s": round(token_json_rate, 1),
        "token_json_ratio": round(token_json_rate / message_rate, 2),
        # measured: the share of the JSON read's token path that is validating the record's turns
        "token_validation_share": round(token_json_rate / validation_rate, 3),
        "identical_tokens": True,
        # slime's mask trains the newline after each <|im_end|>: 4 per conversation here
        "baseline_mask_differences": mask_diff,
        "rounds_per_s": rates,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="256 samples instead of 1024")
    r = run(quick=parser.parse_args(argv).quick)
    print(f"sample building: {r['samples']} distinct {r['assistant_turns']}-turn tool-use trajectories")
    print(f"  message path        {r['message_per_s']:>9.1f} samples/s  {r['message_ratio']:>6.2f}x per-message baseline")
    print(f"  message path, no block cache {r['message_no_cache_per_s']:>9.1f} samples/s  "
          f"{r['message_no_cache_ratio']:>6.2f}x")
    print(f"  per-message (slime) {r['per_message_baseline_per_s']:>9.1f} samples/s  (tokens identical; its mask "
          f"differs in {r['baseline_mask_differences']} tokens: the newline after each <|im_end|>)")
    print(f"  token path          {r['token_per_s']:>9.1f} samples/s  {r['token_ratio']:>6.2f}x message path")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
