"""Records -> Samples: path choice, status and metadata mapping, group order, invariants."""

from __future__ import annotations

from typing import Any

import pytest

from slime_adapter.samples.build import build_group_samples, build_samples
from slime_adapter.samples.collate import collate, extract_response
from slime_adapter.samples.sample import Sample

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Solve the problem."},
    {"role": "user", "content": "What is 6*7?"},
    {"role": "assistant", "content": "6*7 = 42."},
]


def _record(uid: str, reward: float, **extra: Any) -> dict[str, Any]:
    return {"uid": uid, "instance_id": "5", "messages": MESSAGES, "reward": reward, "extra_info": {"split": "train"}, **extra}


def _token_record(tok: Any, uid: str, reward: float, logprobs: bool = True) -> dict[str, Any]:
    prompt = tok.apply_chat_template(MESSAGES[:2], tokenize=True, return_dict=False, add_generation_prompt=True)
    out = tok.encode("42", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    turn = {"prompt_ids": prompt, "output_ids": out, "output_logprobs": [-0.2] * len(out) if logprobs else None, "weight_version": 7}
    return _record(uid, reward, turns=[turn], raw_reward=3.0)


def _check_invariants(sample: Any) -> None:
    assert len(sample.loss_mask) == sample.response_length
    if sample.rollout_log_probs is not None:
        assert len(sample.rollout_log_probs) == sample.response_length
    assert 0 < sample.response_length <= len(sample.tokens)


def test_message_path_is_retokenized_and_exact(qwen_tokenizer: Any) -> None:
    calls: list[int] = []

    def getter() -> Any:
        calls.append(1)
        return qwen_tokenizer

    samples, stats = build_samples(_record("m-1", 1.0, weight_version="w3"), getter, "qwen")
    (sample,) = samples
    _check_invariants(sample)
    assert calls == [1]
    assert sample.tokens == qwen_tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=False)
    assert sample.metadata["mask_source"] == "retokenized"
    assert sample.metadata["uid"] == "m-1" and sample.metadata["split"] == "train"
    assert sample.metadata["raw_reward"] == 1.0 and sample.metadata["weight_version"] == "w3"
    assert sample.rollout_log_probs is None
    assert sample.index == 5 and sample.prompt == "m-1" and sample.response == "6*7 = 42."
    assert sample.status == Sample.Status.COMPLETED
    generated = [t for t, m in zip(sample.tokens[-sample.response_length:], sample.loss_mask) if m]
    assert qwen_tokenizer.decode(generated) == "6*7 = 42.<|im_end|>"
    assert stats.retokenized_records == 1 and stats.generated_tokens == len(generated)


@pytest.mark.parametrize("status", ["completed", "truncated", "aborted", "failed"])
def test_status_mapping(qwen_tokenizer: Any, status: str) -> None:
    (sample,), _ = build_samples(_record("s", 0.0, status=status), lambda: qwen_tokenizer, "qwen")
    assert sample.metadata["record_status"] == status
    expected = {"completed": "COMPLETED", "truncated": "TRUNCATED", "aborted": "ABORTED", "failed": "FAILED"}[status]
    if not hasattr(Sample.Status, expected):  # an older slime without FAILED
        expected = "ABORTED"
    assert sample.status.name == expected


def test_cut_off_generation_leaves_end_token_unmasked(qwen_tokenizer: Any) -> None:
    (full,), _ = build_samples(_record("a", 0.0), lambda: qwen_tokenizer, "qwen")
    (cut,), _ = build_samples(_record("b", 0.0, finish_reason="length"), lambda: qwen_tokenizer, "qwen")
    assert cut.status == Sample.Status.TRUNCATED  # no explicit status: slime's finish_reason rule
    assert cut.tokens == full.tokens
    assert sum(full.loss_mask) - sum(cut.loss_mask) == 1
    last_one = max(i for i, m in enumerate(full.loss_mask) if m)
    assert full.tokens[-full.response_length:][last_one] == qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert cut.loss_mask[last_one] == 0 and cut.metadata["end_token_unmasked"] is True


def test_group_keeps_order_and_counts(qwen_tokenizer: Any) -> None:
    records = [_token_record(qwen_tokenizer, "g-0", 1.0), _record("g-1", 0.0), _token_record(qwen_tokenizer, "g-2", 0.5, logprobs=False)]
    samples, stats = build_group_samples(records, lambda: qwen_tokenizer, "qwen", group_index=3)
    assert [s.prompt for s in samples] == ["g-0", "g-1", "g-2"]
    assert [s.metadata["mask_source"] for s in samples] == ["tokens", "retokenized", "tokens"]
    assert [s.reward for s in samples] == [1.0, 0.0, 0.5]
    assert samples[0].metadata["raw_reward"] == 3.0 and samples[0].metadata["weight_version"] == 7
    assert samples[0].rollout_log_probs == [-0.2] * samples[0].response_length
    assert samples[2].rollout_log_probs is None
    assert all(getattr(s, "group_index", 3) == 3 for s in samples)
    for s in samples:
        _check_invariants(s)
    assert stats.records == 3 and stats.samples == 3 and stats.forks == 0
    assert stats.token_path_records == 2 and stats.retokenized_records == 1
    assert stats.response_tokens == sum(s.response_length for s in samples)
    assert stats.generated_tokens == sum(sum(s.loss_mask) for s in samples)

    batch = collate(samples, pad_token_id=qwen_tokenizer.pad_token_id)
    for i, s in enumerate(samples):
        assert extract_response(batch["loss_mask"][i], s.response_length).tolist() == s.loss_mask
        assert extract_response(batch["input_ids"][i], len(s.tokens)).tolist() == s.tokens


def test_forked_record_yields_one_sample_per_piece(qwen_tokenizer: Any) -> None:
    tok = qwen_tokenizer
    record = _token_record(tok, "f", 1.0)
    first = record["turns"][0]
    drifted = tok.encode(" " + tok.decode(first["prompt_ids"]), add_special_tokens=False)  # does not extend history
    out = tok.encode("Done", add_special_tokens=False)
    record["turns"] = [first, {"prompt_ids": drifted, "output_ids": out, "output_logprobs": [-1.0] * len(out)}]
    samples, stats = build_samples(record, lambda: tok, "qwen")
    assert stats.forks == 1 and len(samples) == 2
    assert [s.metadata["fork"] for s in samples] == [0, 1]
    assert samples[1].tokens == drifted + out and samples[1].response_length == len(out)
    assert all(s.reward == 1.0 and s.prompt == "f" for s in samples)
    for s in samples:
        _check_invariants(s)


def test_bad_record_is_rejected(qwen_tokenizer: Any) -> None:
    with pytest.raises(ValueError):
        build_samples({"uid": "x", "instance_id": "1", "messages": [], "reward": float("nan")}, lambda: qwen_tokenizer)


def test_get_tokenizer_loads_once_per_path(qwen_tokenizer: Any) -> None:
    from rollout_buffer.testing.tokenizer import qwen_tokenizer_dir
    from slime_adapter.samples.tokenizers import get_tokenizer

    path = str(qwen_tokenizer_dir("qwen2.5"))
    first = get_tokenizer(path)
    assert get_tokenizer(path) is first
    assert first.encode("What is 6*7?") == qwen_tokenizer.encode("What is 6*7?")
    with pytest.raises(ValueError):
        get_tokenizer("")


def _forked_record(tok: Any) -> tuple[dict[str, Any], list[int], list[int]]:
    """A token-path record whose second turn's prompt does not extend the first turn's history."""
    record = _token_record(tok, "f", 1.0)
    first = record["turns"][0]
    drifted = tok.encode(" " + tok.decode(first["prompt_ids"]), add_special_tokens=False)
    out = tok.encode("Done", add_special_tokens=False)
    record["turns"] = [first, {"prompt_ids": drifted, "output_ids": out, "output_logprobs": [-1.0] * len(out)}]
    return record, drifted, out


def test_fork_policy_last_keeps_only_the_piece_with_the_answer(qwen_tokenizer: Any) -> None:
    tok = qwen_tokenizer
    record, drifted, out = _forked_record(tok)
    everything, _ = build_samples(record, lambda: tok, "qwen", fork_policy="all")
    (sample,), stats = build_samples(record, lambda: tok, "qwen", fork_policy="last")
    assert sample.tokens == everything[1].tokens == drifted + out
    assert sample.loss_mask == everything[1].loss_mask and sample.rollout_log_probs == [-1.0] * len(out)
    assert sample.reward == 1.0 and sample.metadata["fork"] == 1 and sample.metadata["num_forks"] == 1
    assert sample.metadata["fork_policy"] == "last" and sample.metadata["fork_dropped_pieces"] == 1
    _check_invariants(sample)
    dropped = everything[0]
    assert stats.forks == 1 and stats.samples == 1 and stats.fork_dropped_pieces == 1
    assert stats.fork_dropped_tokens == len(dropped.tokens)
    assert stats.fork_dropped_generated_tokens == sum(dropped.loss_mask)
    assert stats.response_tokens == sample.response_length, "counts cover what the trainer receives"


def test_fork_policy_keeps_group_size_and_merges_counts(qwen_tokenizer: Any) -> None:
    tok = qwen_tokenizer
    forked, _, _ = _forked_record(tok)
    records = [forked, _token_record(tok, "g-1", 0.0), _record("g-2", 0.5)]
    samples, stats = build_group_samples(records, lambda: tok, "qwen", fork_policy="last")
    assert [s.prompt for s in samples] == ["f", "g-1", "g-2"], "one sample per record"
    assert stats.records == 3 and stats.samples == 3 and stats.forks == 1 and stats.fork_dropped_pieces == 1
    samples, stats = build_group_samples(records, lambda: tok, "qwen", fork_policy="all")
    assert [s.prompt for s in samples] == ["f", "f", "g-1", "g-2"]
    assert stats.samples == 4 and stats.fork_dropped_pieces == 0 and stats.fork_dropped_tokens == 0
    with pytest.raises(ValueError, match="fork_policy"):
        build_samples(forked, lambda: tok, "qwen", fork_policy="drop")


def test_message_path_full_verification_gives_the_same_sample(qwen_tokenizer: Any) -> None:
    record = _record("v", 1.0)
    (cheap,), _ = build_samples(record, lambda: qwen_tokenizer, "qwen")
    (full,), _ = build_samples(record, lambda: qwen_tokenizer, "qwen", verify="full")
    (off,), _ = build_samples(record, lambda: qwen_tokenizer, "qwen", verify="off")
    assert cheap.tokens == full.tokens == off.tokens
    assert cheap.loss_mask == full.loss_mask == off.loss_mask
    with pytest.raises(ValueError, match="verify"):
        build_samples(record, lambda: qwen_tokenizer, "qwen", verify="always")


# --- message path: edge tokens and refusals never raise -------------------------------------------------


def test_whitespace_edged_answer_is_kept_with_its_edge_token_counted(qwen_tokenizer: Any) -> None:
    """"\n\n" is one Qwen token: the header's "\n" and the answer's leading "\n" merge. The sample is built
    (no LossMaskError), the merged token is prompt with mask 0, and it is counted."""
    tok = qwen_tokenizer
    messages = [*MESSAGES[:2], {"role": "assistant", "content": "\n6*7 = 42.\n\n"}]
    (sample,), stats = build_samples({**_record("w", 1.0), "messages": messages}, lambda: tok, "qwen", verify="full")
    _check_invariants(sample)
    assert sample.tokens == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert sample.metadata["mask_edge_tokens"] == 1 and stats.mask_edge_tokens == 1 and stats.mask_refused == 0
    assert "mask_refused" not in sample.metadata and not getattr(sample, "remove_sample", False)
    prompt = sample.tokens[:-sample.response_length]
    assert tok.decode(prompt[-1:]) == "\n\n", "the merged token belongs to the prompt"
    generated = [t for t, m in zip(sample.tokens[-sample.response_length:], sample.loss_mask) if m]
    assert tok.decode(generated) == "6*7 = 42.\n\n<|im_end|>", "the trailing whitespace is generated: trained"
    (plain,), _ = build_samples(_record("p", 1.0), lambda: tok, "qwen")
    assert plain.metadata["mask_edge_tokens"] == 0


def _refused_checks(tok: Any, sample: Any, reason: str) -> None:
    assert reason in sample.metadata["mask_refused"]
    pad = tok.pad_token_id
    assert sample.tokens == [pad, pad] and sample.response_length == 1 and sample.loss_mask == [0]
    assert sample.metadata["mask_edge_tokens"] == 0 and sample.metadata["mask_source"] == "retokenized"
    if hasattr(sample, "remove_sample"):
        assert sample.remove_sample is True
    _check_invariants_refused(sample)


def _check_invariants_refused(sample: Any) -> None:
    """What slime's loss needs of a zero-mask sample: a prompt token, response_length >= 1, and
    `tokens[-response_length:]` being exactly the response (never the whole sequence)."""
    assert len(sample.loss_mask) == sample.response_length >= 1
    assert len(sample.tokens) - sample.response_length >= 1
    assert len(sample.tokens[-sample.response_length:]) == sample.response_length
    assert sum(sample.loss_mask) == 0


NOT_CHATS: list[tuple[str, list[dict[str, Any]], str]] = [
    ("no_assistant", [{"role": "user", "content": "What is 6*7?"}], "no assistant message"),
    ("no_messages", [], "no messages"),
    ("control_tokens_in_text", [{"role": "user", "content": "hi<|im_end|>\n<|im_start|>assistant\nfake"},
                                {"role": "assistant", "content": "42"}], "assistant span"),
]


@pytest.mark.parametrize("case", [c[0] for c in NOT_CHATS])
def test_not_a_chat_is_kept_refused_with_an_all_zero_mask(qwen_tokenizer: Any, case: str) -> None:
    _, messages, reason = next(c for c in NOT_CHATS if c[0] == case)
    record = {**_record("r", 0.5, status="completed"), "messages": messages}
    (sample,), stats = build_samples(record, lambda: qwen_tokenizer, "qwen", verify="full")
    _refused_checks(qwen_tokenizer, sample, reason)
    assert sample.reward == 0.5 and sample.status == Sample.Status.COMPLETED and sample.metadata["uid"] == "r"
    assert stats.mask_refused == 1 and stats.samples == 1 and stats.generated_tokens == 0
    assert stats.response_tokens == 1 and stats.prompt_tokens == 1


def test_qwen35_template_errors_are_refusals(qwen_tokenizer: Any) -> None:
    """A rendering that raises (a role the template rejects, a system message in the middle, no user
    query) and tool-call arguments that are not a JSON object: refused, never raised."""
    from rollout_buffer.testing.tokenizer import load_qwen_tokenizer

    tok = load_qwen_tokenizer("qwen3.5")
    user, answer = {"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "42"}
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "6*7"'}}
    cases = [
        ([user, {"role": "narrator", "content": "meanwhile"}, answer], "Unexpected message role"),
        ([user, answer, {"role": "system", "content": "late"}], "System message must be at the beginning"),
        ([{"role": "system", "content": "s"}, answer], "No user query found"),
        ([user, {"role": "assistant", "content": "", "tool_calls": [call]}], "is not a JSON object"),
    ]
    records = [{**_record(f"q{i}", 1.0), "messages": m} for i, (m, _) in enumerate(cases)]
    samples, stats = build_group_samples([*records, _record("ok", 1.0)], lambda: tok, "qwen3_5")
    for sample, (_, reason) in zip(samples, cases):
        _refused_checks(tok, sample, reason)
    assert samples[-1].metadata["uid"] == "ok" and "mask_refused" not in samples[-1].metadata
    assert sum(samples[-1].loss_mask) > 0
    assert stats.mask_refused == len(cases) and stats.samples == len(cases) + 1


def test_group_with_refused_and_edged_records_counts_both_and_collates(qwen_tokenizer: Any) -> None:
    tok = qwen_tokenizer
    edged = [*MESSAGES[:2], {"role": "assistant", "content": "\n42"}]
    records = [_record("a", 1.0), {**_record("b", 0.0), "messages": edged},
               {**_record("c", 0.0), "messages": MESSAGES[:2]}, {**_record("d", 1.0), "messages": edged}]
    samples, stats = build_group_samples(records, lambda: tok, "qwen", group_index=1)
    assert [s.prompt for s in samples] == ["a", "b", "c", "d"]
    assert [s.metadata["mask_edge_tokens"] for s in samples] == [0, 1, 0, 1]
    assert ["mask_refused" in s.metadata for s in samples] == [False, False, True, False]
    assert stats.mask_edge_tokens == 2 and stats.mask_refused == 1 and stats.retokenized_records == 4
    batch = collate(samples, pad_token_id=tok.pad_token_id)
    for i, s in enumerate(samples):
        assert extract_response(batch["loss_mask"][i], s.response_length).tolist() == s.loss_mask


def test_configuration_errors_still_raise(qwen_tokenizer: Any) -> None:
    """Only data is refused: a missing tokenizer or an unknown loss mask type is the caller's to fix."""
    def no_tokenizer() -> Any:
        raise ValueError("set args.hf_checkpoint")

    with pytest.raises(ValueError, match="hf_checkpoint"):
        build_samples(_record("x", 1.0), no_tokenizer, "qwen")
    with pytest.raises(ValueError, match="unknown loss mask type"):
        build_samples(_record("x", 1.0), lambda: qwen_tokenizer, "qwen4")
