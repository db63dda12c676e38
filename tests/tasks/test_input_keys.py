"""slime's dataset keys: how a line of a prompt file becomes the sample a task sees, and the built-in tasks'
checks of it. Lines are in the shapes slime's own data files have (dapo-math-17k: `prompt` as a list of chat
messages, `label`; tools per line as a list or a JSON string; integer ids or none)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_buffer.tasks.builtin import calculator_generator, math_generator
from rollout_buffer.tasks.builtin.boxed import boxed_reward, extract_answer
from rollout_buffer.tasks.contract import InvalidSample
from rollout_buffer.tasks.input_file import InputFileError, iter_lines
from rollout_buffer.tasks.input_keys import InputKeyError, InputKeys, check_prompt, normalise, prompt_messages

DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
               "What is 3 + 4?\n\nRemember to put your answer on its own line after \"Answer:\".")
DAPO_LINE = {"prompt": [{"content": DAPO_PROMPT, "role": "user"}], "label": "7",
             "metadata": {"source": "dapo", "split": "train"}, "instance_id": "3"}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# slime's namespace for dapo-math-17k: --input-key prompt --label-key label --apply-chat-template, --tool-key unset
DAPO_KEYS = {"input_key": "prompt", "label_key": "label", "metadata_key": "metadata", "tool_key": None}


def test_a_dapo_line_keeps_its_message_list_label_and_metadata() -> None:
    keys = InputKeys.from_options(DAPO_KEYS)
    assert keys == InputKeys(input_key="prompt", label_key="label", metadata_key="metadata", tool_key=None)
    sample = normalise({**DAPO_LINE, "tools": [WEATHER_TOOL]}, keys)
    assert sample["prompt"] == DAPO_LINE["prompt"] and sample["label"] == "7"
    assert sample["metadata"] == {"source": "dapo", "split": "train"} and sample["instance_id"] == "3"
    assert sample["tools"] is None, "a null tool_key reads no tools, as slime does with --tool-key unset"
    math_generator.validate_sample(sample)
    assert math_generator.prompt_messages(sample) == DAPO_LINE["prompt"], "a chat prompt is used as given"


def test_custom_keys_and_tools_as_a_json_string() -> None:
    keys = InputKeys.from_options({"input_key": "question", "label_key": "gold", "metadata_key": "meta",
                                   "tool_key": "tool_list"})
    line = {"question": "What is 6 * 7?", "gold": 42, "meta": {"level": 1}, "tool_list": json.dumps([WEATHER_TOOL]),
            "prompt": "an unrelated field", "instance_id": "0"}
    sample = normalise(line, keys)
    assert (sample["prompt"], sample["label"], sample["metadata"]) == ("What is 6 * 7?", 42, {"level": 1})
    assert sample["tools"] == [WEATHER_TOOL], "slime decodes a JSON-string tool list too"
    assert sample["question"] == "What is 6 * 7?" and sample["tool_list"] == line["tool_list"], "raw keys kept"
    messages = math_generator.prompt_messages(sample)
    assert messages == [{"role": "user", "content": f"What is 6 * 7?\n{math_generator.INSTRUCTION}"}]
    assert [t["function"]["name"] for t in calculator_generator.offered_tools(sample)] == ["calculator", "get_weather"]
    assert keys.source_of("prompt") == "'question' (input_key)" and keys.source_of("tools") == "'tool_list' (tool_key)"


def test_defaults_when_no_key_is_sent() -> None:
    keys = InputKeys.from_options({})
    assert keys == InputKeys(input_key=None, label_key=None, metadata_key="metadata", tool_key="tools")
    assert normalise({"messages": [{"role": "user", "content": "hi"}], "answer": "5"}, keys)["label"] == "5"
    assert normalise({"question": "q?", "label": "1", "answer": "2"}, keys)["prompt"] == "q?"
    sample = normalise({"prompt": "p", "tools": [WEATHER_TOOL]}, keys)
    assert sample["tools"] == [WEATHER_TOOL] and sample["metadata"] == {} and sample["label"] is None
    assert InputKeys.from_options({"label_key": None}).label_key is None, "slime's default label_key (None): search"
    assert keys.source_of("prompt", {"question": "q"}) == "'question'"


def test_bad_shapes_name_their_field() -> None:
    keys = InputKeys.from_options({})
    for line, field in (({"prompt": "p", "metadata": [1]}, "metadata"), ({"prompt": "p", "tools": {"a": 1}}, "tools"),
                        ({"prompt": "p", "tools": "[not json"}, "tools"), ({"prompt": "p", "tools": [1]}, "tools")):
        with pytest.raises(InvalidSample) as caught:
            normalise(line, keys)
        assert caught.value.field == field
    for setting, value in (("input_key", 3), ("tool_key", " "), ("label_key", ["a"])):
        with pytest.raises(InputKeyError) as bad:
            InputKeys.from_options({setting: value})
        assert bad.value.field == setting


@pytest.mark.parametrize(("prompt", "reason"), [
    (None, "missing"), ("  ", "is empty"), (7, "expected text or a list"), ([], "empty message list"),
    ([{"content": "no role"}], "string 'role'"), ([{"role": "user", "content": None}], "no string or list 'content'"),
])
def test_prompts_a_task_cannot_use(prompt: object, reason: str) -> None:
    with pytest.raises(InvalidSample, match=reason):
        check_prompt(prompt)
    with pytest.raises(InvalidSample):
        math_generator.validate_sample({"prompt": prompt, "label": "1"})


def test_the_math_tasks_need_a_label() -> None:
    sample = normalise({"prompt": "What is 1 + 1?"}, InputKeys.from_options({"label_key": "label"}))
    with pytest.raises(InvalidSample) as caught:
        calculator_generator.validate_sample(sample)
    assert caught.value.field == "label"
    assert prompt_messages("text") == [{"role": "user", "content": "text"}]


def test_final_answers_in_boxed_and_dapo_form() -> None:
    assert extract_answer("so \\boxed{12} and Answer: 13") == "12", "a boxed answer wins"
    assert extract_answer("3 + 4 = 7.\nAnswer: 7") == "7"
    assert extract_answer("answer: $\\frac{1}{2}$\nmore\nAnswer:  42 ") == "42", "the last Answer: line"
    assert extract_answer("no final answer") is None
    assert boxed_reward("work...\nAnswer: $7$", "7") == 1.0 and boxed_reward("Answer: 8", "7") == 0.0


def test_integer_ids_and_lines_without_ids(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({**DAPO_LINE, "instance_id": 17}) + "\n\n" + json.dumps({"prompt": "x"}) + "\n")
    assert [(n, line["instance_id"]) for n, line in iter_lines(path)] == [(1, "17"), (3, "2")]
    path.write_text(json.dumps({"prompt": "x", "instance_id": 1}) + "\n" + json.dumps({"prompt": "y"}) + "\n")
    with pytest.raises(InputFileError, match="line 2: duplicate instance_id '1'"):
        list(iter_lines(path))
