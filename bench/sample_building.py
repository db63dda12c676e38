"""Sample building throughput: token path vs message path vs slime's per-prefix re-rendering.

Trajectories are 4-turn tool-use conversations (three calculator calls, then an answer) with real token
turns, made by rendering each engine call's prompt with the real Qwen2.5 tokenizer, as a worker records
them. Records come in groups of `GROUP` per instance id that share their prompt, as a GRPO group's samples
do. Three builders make one training sample per trajectory:

* token path: `build_samples` on records with `turns` (no tokenizer at all);
* message path: `build_samples` on the same records without `turns` (one render + one tokenization with
  offsets, the prompt's tokens reused within a group, checked by the generator's "cheap" invariants).
  Timed too, for reference: the same with the prompt cache off (as if no two records shared a prompt),
  and with `verify="full"` (a second, independent `apply_chat_template(..., tokenize=True)` per record);
* naive baseline: slime's way, the chat template rendered and tokenized once per message prefix, the
  mask built from the length differences.

The message path (every variant) and the baseline must produce identical tokens and masks (the baseline's
last prefix is `apply_chat_template(messages, tools=..., tokenize=True)` itself); the run fails otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from typing import Any

from rollout_buffer.testing.tokenizer import load_qwen_tokenizer
from slime_adapter.build import build_samples
from slime_adapter.loss_mask import cached_loss_mask_generator

__all__ = ["GROUP", "main", "make_trajectories", "naive_prompt_response", "run"]

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]
DISTINCT = 128  # distinct conversations; more records repeat them under new uids
GROUP = 8  # records per instance id: the samples of one prompt (n_samples_per_prompt)


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


def make_trajectories(n: int, seed: int = 0, repeat: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`n` records with `turns` and the same `n` without, over at most `DISTINCT` distinct conversations.

    `repeat` consecutive records share one conversation: `GROUP` makes each instance id's group share its
    prompt, as a GRPO group does; 1 (the default) cycles through the conversations, so neighbouring records
    share nothing (the worst case for anything cached per prompt).
    """
    tok = load_qwen_tokenizer("qwen2.5")
    rng = random.Random(seed)
    pool = []
    for _ in range(min(-(-n // repeat), DISTINCT)):
        messages = _conversation(rng)
        pool.append((messages, _turns(tok, messages, rng)))
    with_turns, without = [], []
    for i in range(n):
        messages, turns = pool[(i // repeat) % len(pool)]
        base = {"uid": f"u{i}", "instance_id": str(i // GROUP), "messages": messages, "tools": TOOLS,
                "reward": float(i % 2), "extra_info": {}}
        with_turns.append({**base, "turns": turns})
        without.append(base)
    return with_turns, without


def naive_prompt_response(tok: Any, messages: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None) -> tuple[list[int], list[int], list[int]]:
    """slime's approach: render and tokenize every message prefix; the new ids of an assistant message
    (minus its `<|im_start|>assistant\\n` header and what follows `<|im_end|>`) get mask 1."""
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    ids: list[int] = []
    mask: list[int] = []
    for j, message in enumerate(messages):
        full = list(tok.apply_chat_template(messages[:j + 1], tools=tools, tokenize=True, return_dict=False))
        if full[:len(ids)] != ids:
            raise ValueError(f"prefix {j} does not extend the previous rendering")
        new = full[len(ids):]
        if message["role"] == "assistant":
            header = len(tok.apply_chat_template(messages[:j], tools=tools, tokenize=True, return_dict=False,
                                                 add_generation_prompt=True)) - len(ids)
            last = max(i for i, t in enumerate(new) if t == end_id)
            mask.extend([0] * header + [1] * (last + 1 - header) + [0] * (len(new) - last - 1))
        else:
            mask.extend([0] * len(new))
        ids = full
    split = mask.index(1)
    return ids[:split], ids[split:], mask[split:]


def _rate(n: int, build: Callable[[], list[Any]]) -> tuple[float, list[Any]]:
    began = time.perf_counter()
    out = build()
    return n / (time.perf_counter() - began), out


def run(quick: bool = False) -> dict[str, Any]:
    """Build 1024 samples (256 when `quick`) each way; returns rates, ratios and the identity check."""
    n = 256 if quick else 1024
    tok = load_qwen_tokenizer("qwen2.5")
    getter = lambda: tok
    with_turns, without = make_trajectories(n, repeat=GROUP)  # groups share their prompt
    for verify in ("cheap", "full"):  # warm the tokenizer, template and generator caches for every builder
        build_samples(without[0], getter, "qwen", verify=verify)
        cached_loss_mask_generator("qwen", tok, verify).clear_prompt_cache()

    token_rate, token_samples = _rate(n, lambda: [build_samples(r, getter, "qwen")[0][0] for r in with_turns])
    message_rate, message_samples = _rate(n, lambda: [build_samples(r, getter, "qwen")[0][0] for r in without])
    generator = cached_loss_mask_generator("qwen", tok)
    cache_size, generator.prompt_cache_size = generator.prompt_cache_size, 0  # as if no record shared a prompt
    uncached_rate, uncached_samples = _rate(n, lambda: [build_samples(r, getter, "qwen")[0][0] for r in without])
    generator.prompt_cache_size = cache_size
    full_rate, full_samples = _rate(n, lambda: [build_samples(r, getter, "qwen", verify="full")[0][0]
                                                for r in without])
    naive_rate, naive = _rate(n, lambda: [naive_prompt_response(tok, r["messages"], r["tools"]) for r in without])

    for sample, uncached, full, (prompt, response, mask) in zip(message_samples, uncached_samples, full_samples,
                                                                naive):
        if sample.tokens != prompt + response or sample.loss_mask != mask:
            raise AssertionError(f"message path and naive baseline differ for {sample.metadata['uid']}")
        if uncached.tokens != sample.tokens or uncached.loss_mask != sample.loss_mask:
            raise AssertionError(f"the prompt cache changed the sample of {sample.metadata['uid']}")
        if full.tokens != sample.tokens or full.loss_mask != sample.loss_mask:
            raise AssertionError(f"verify='full' and verify='cheap' differ for {sample.metadata['uid']}")
    for tokens_sample, message_sample in zip(token_samples, message_samples):
        assert tokens_sample.metadata["mask_source"] == "tokens" and "fork" not in tokens_sample.metadata
        assert sum(tokens_sample.loss_mask) == sum(message_sample.loss_mask), "both mask the same generated ids"
    return {
        "samples": n,
        "assistant_turns": 4,
        "token_path_samples_per_s": round(token_rate, 1),
        "message_path_samples_per_s": round(message_rate, 1),
        "naive_samples_per_s": round(naive_rate, 1),
        "token_vs_naive": round(token_rate / naive_rate, 2),
        "message_vs_naive": round(message_rate / naive_rate, 2),
        "message_path_identical_to_naive": True,
        "message_path_full_verify_samples_per_s": round(full_rate, 1),
        "message_full_verify_vs_naive": round(full_rate / naive_rate, 2),
        "message_path_no_prompt_cache_samples_per_s": round(uncached_rate, 1),
        "message_no_prompt_cache_vs_naive": round(uncached_rate / naive_rate, 2),
        # the names the issue asks for
        "token_per_s": round(token_rate, 1),
        "message_per_s": round(message_rate, 1),
        "naive_per_s": round(naive_rate, 1),
        "token_ratio": round(token_rate / naive_rate, 2),
        "message_ratio": round(message_rate / naive_rate, 2),
        "identical_tokens": True,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="256 samples instead of 1024")
    result = run(quick=parser.parse_args(argv).quick)
    print(f"sample building: {result['samples']} samples of {result['assistant_turns']}-turn tool-use trajectories")
    print(f"  token path    {result['token_path_samples_per_s']:>9.1f} samples/s  {result['token_vs_naive']:>7.2f}x naive")
    print(f"  message path  {result['message_path_samples_per_s']:>9.1f} samples/s  {result['message_vs_naive']:>7.2f}x naive"
          "  (verify='cheap', the default; groups of 8 share a prompt)")
    print(f"  message path  {result['message_path_no_prompt_cache_samples_per_s']:>9.1f} samples/s  "
          f"{result['message_no_prompt_cache_vs_naive']:>7.2f}x naive  (prompt cache off: no record shares a prompt)")
    print(f"  message path  {result['message_path_full_verify_samples_per_s']:>9.1f} samples/s  "
          f"{result['message_full_verify_vs_naive']:>7.2f}x naive  (verify='full': second apply_chat_template)")
    print(f"  naive         {result['naive_samples_per_s']:>9.1f} samples/s")
    print("  message path tokens and masks identical to naive (and to apply_chat_template): yes")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
