"""Rule-based answer checking for the built-in tasks: the model's final answer against a label.

The final answer is the content of the last `\\boxed{...}`, or, in a response without one, the text after
the last `Answer:` (the format DAPO-Math-17k's prompts ask for: "The last line of your response should be
of the form Answer: $Answer"). Not a task module (its name does not end in `_generator.py`); the math and
calculator tasks share it.
"""

from __future__ import annotations

import math
import re
from typing import Any

_BOXED = "\\boxed{"
_NOISE = re.compile(r"\\[!,;: ]|\$|\\left|\\right|\s+")
_TEXT_WRAPPER = re.compile(r"^\\(?:text|mathrm|textbf)\{(.*)\}$")
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")  # DAPO's answer pattern (slime's math_dapo_utils)


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth = 1
    i = start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer: the last `\\boxed{...}`, else the text after the last `Answer:`, else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(text)
    return lines[-1].strip() if lines else None


def normalize(answer: str) -> str:
    """Drop spacing, `$`, `\\left`/`\\right`, a `\\text{}` wrapper, a trailing period, thousands separators."""
    text = _NOISE.sub("", answer.strip()).rstrip(".")
    wrapped = _TEXT_WRAPPER.match(text)
    if wrapped:
        text = wrapped.group(1)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return text


def _as_number(text: str) -> float | None:
    fraction = re.fullmatch(r"(-?)\\d?frac\{(-?\d+)\}\{(-?\d+)\}", text)
    if fraction:
        sign, top, bottom = fraction.groups()
        value = int(top) / int(bottom) if int(bottom) else None
        return None if value is None else (-value if sign else value)
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def answers_match(predicted: str | None, label: Any) -> bool:
    """Equal after normalisation, or numerically equal (1e-6 relative)."""
    if predicted is None or label is None:
        return False
    label_text = str(label)
    boxed_label = extract_boxed(label_text)
    expected = normalize(boxed_label if boxed_label is not None else label_text)
    got = normalize(predicted)
    if got == expected:
        return True
    a, b = _as_number(got), _as_number(expected)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def boxed_reward(response: str, label: Any) -> float:
    """1.0 when the response's final answer (`extract_answer`) matches the label, else 0.0."""
    return 1.0 if answers_match(extract_answer(response), label) else 0.0
