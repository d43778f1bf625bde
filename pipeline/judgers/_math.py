"""The ``math`` judger: final-answer extraction and numeric / fraction / string equivalence.

Extraction takes, in order: the last ``\\boxed{...}`` (or ``\\fbox{...}``, nested braces
allowed), a GSM8K-style ``#### answer`` line, an "answer is ..." phrase, and (optionally) the
last number in the text. Normalization removes LaTeX decoration (``$``, ``\\left``,
``\\text{}``, degrees, percent, thousands separators, ``x =``) and rewrites ``\\frac{a}{b}`` as
``(a)/(b)``; two answers are equal when both parse as exact fractions that are equal (or
within ``rel_tol``), otherwise when their normalized strings are equal. It is pure Python with
linear-time patterns, cheap enough to run on the event loop.
"""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction
from typing import Any

from pipeline._data.models import AgentRolloutItem
from pipeline.judgers._base import JudgeResult, ground_truths, response_text
from pipeline.judgers._registry import register_judger

_GSM8K = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS = re.compile(r"(?i)(?:final answer|the answer|answer)\s*(?:is|:)\s*:?\s*([^\n]+)")
_NUMBER = re.compile(r"[-+]?(?:\d(?:[\d,]*\d)?(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?")
_UNIT_AFTER_NUMBER = re.compile(r"(\d)\s*\\(?:text|mbox|mathrm)\s*\{[^{}]*\}")
_TEXT_WRAPPER = re.compile(
    r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_FRAC = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*=(?!=)(.+)$")
_PLAIN_INT = re.compile(r"^-?\d{1,30}$")
_SPACE = re.compile(r"\s+")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL = r"[-+]?[\d.]+(?:[eE][-+]?\d+)?"
_RATIO = re.compile(rf"^([-+]?)\(?({_DECIMAL})\)?/\(?({_DECIMAL})\)?$")
_DROP = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "°",
         "\\%", "%")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``), else None."""
    start = -1
    for macro in ("\\boxed", "\\fbox"):
        found = text.rfind(macro)
        if found > start:
            start, length = found, len(macro)
    if start < 0:
        return None
    i = start + length
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        match = re.match(r"[^\s$]+", text[i:])
        return match.group(0) if match and i > start + length else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def extract_answer(text: str, *, fallback_last_number: bool = True) -> tuple[str | None, str]:
    """The final answer in ``text`` and how it was found.

    Returns:
        ``(answer, method)`` with method ``boxed``, ``gsm8k``, ``answer_is``, ``last_number``
        or ``none`` (answer None).
    """
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    tail = text[-4000:]
    found = _GSM8K.findall(tail)
    if found:
        return found[-1].strip(), "gsm8k"
    found = _ANSWER_IS.findall(tail)
    if found:
        return found[-1].strip().rstrip("."), "answer_is"
    if fallback_last_number:
        numbers = _NUMBER.findall(tail)
        if numbers:
            return numbers[-1], "last_number"
    return None, "none"


@functools.lru_cache(maxsize=4096)
def normalize_answer(answer: str) -> str:
    """A canonical string for comparison (see the module doc)."""
    s = answer.strip()
    if _PLAIN_INT.match(s):
        return s
    for left, right in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right):
            s = s[len(left):-len(right)]
    boxed = extract_boxed(s)
    if boxed is not None:
        s = boxed
    s = _UNIT_AFTER_NUMBER.sub(r"\1", s)
    s = _TEXT_WRAPPER.sub(r"\1", s)
    s = _DEGREES.sub("", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = s.replace("\\cdot", "*").replace("\\times", "*")
    previous = None
    while previous != s:
        previous, s = s, _FRAC.sub(r"(\1)/(\2)", s)
    s = _FRAC_SHORT.sub(r"(\1)/(\2)", s)
    s = _SPACE.sub("", s).rstrip(".")
    match = _ASSIGNMENT.match(s)
    if match:
        s = match.group(1)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s[1:] if s.startswith("+") else s


@functools.lru_cache(maxsize=4096)
def to_fraction(normalized: str) -> Fraction | None:
    """The exact value of a normalized number, decimal, ``a/b`` or ``(a)/(b)``; else None."""
    if _PLAIN_INT.match(normalized):
        return Fraction(int(normalized))
    try:
        return Fraction(normalized)
    except (ValueError, ZeroDivisionError):
        pass
    match = _RATIO.match(normalized)
    if match is None:
        return None
    try:
        value = Fraction(match.group(2)) / Fraction(match.group(3))
    except (ValueError, ZeroDivisionError):
        return None
    return -value if match.group(1) == "-" else value


def answers_equal(answer: str, truth: str, *, rel_tol: float = 1e-6) -> tuple[bool, str]:
    """Whether two answers are equivalent, and how that was decided (``numeric``/``string``)."""
    a, b = normalize_answer(answer), normalize_answer(truth)
    if a == b:
        return True, "numeric" if _PLAIN_INT.match(a) else "string"
    fa, fb = to_fraction(a), to_fraction(b)
    if fa is not None and fb is not None:
        if fa == fb:
            return True, "numeric"
        return math.isclose(fa, fb, rel_tol=rel_tol, abs_tol=0.0), "numeric"
    return a == b, "string"


@register_judger("math")
class MathJudger:
    """Scores ``correct_score`` when the extracted final answer equals the ground truth.

    The ground truth may be a string (``\\boxed{}`` allowed), a number, or a list of accepted
    answers.

    Args:
        rel_tol: relative tolerance for numeric answers that are not exactly equal.
        fallback_last_number: use the last number in the text when nothing else marks the
            answer.
        correct_score: the score of a correct answer.
        incorrect_score: the score of any other answer.
    """

    name = "math"

    def __init__(self, *, rel_tol: float = 1e-6, fallback_last_number: bool = True,
                 correct_score: float = 1.0, incorrect_score: float = 0.0) -> None:
        self.rel_tol = rel_tol
        self.fallback_last_number = fallback_last_number
        self.correct_score = correct_score
        self.incorrect_score = incorrect_score

    async def judge(self, item: AgentRolloutItem) -> JudgeResult:
        """Extract the answer and compare it with every accepted ground truth.

        Raises:
            JudgeError: the row has no ground truth.
        """
        truths = ground_truths(item.data.ground_truth)
        answer, method = extract_answer(response_text(item),
                                        fallback_last_number=self.fallback_last_number)
        payload: dict[str, Any] = {"extracted": answer, "extraction": method,
                                   "ground_truth": truths if len(truths) > 1 else truths[0]}
        if answer is None:
            payload["reason"] = "no final answer found"
            return JudgeResult(score=self.incorrect_score, payload=payload)
        for truth in truths:
            equal, how = answers_equal(answer, truth, rel_tol=self.rel_tol)
            payload["comparison"] = how
            if equal:
                return JudgeResult(score=self.correct_score, payload=payload)
        return JudgeResult(score=self.incorrect_score, payload=payload)
