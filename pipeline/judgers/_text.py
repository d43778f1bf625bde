"""The ``exact_match`` and ``regex`` judgers: string checks on the final answer.

Both run on the event loop. Python's ``re`` backtracks, so a pathological pattern can take
exponential time; patterns come from your config or dataset, keep them simple (or wrap a
check in a ``FunctionJudger``, which runs in a killable worker process).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pipeline._data.models import AgentRolloutItem
from pipeline.judgers._base import JudgeError, JudgeResult, ground_truths, response_text
from pipeline.judgers._math import extract_boxed
from pipeline.judgers._registry import register_judger


@register_judger("exact_match")
class ExactMatchJudger:
    """1.0 when the answer equals the ground truth (or one of a list), else 0.0.

    Args:
        extract: what part of the answer to compare: the whole text (``"none"``), the last
            ``\\boxed{}`` (``"boxed"``) or the last non-empty line (``"last_line"``).
        case_sensitive: compare case-sensitively.
        normalize_whitespace: strip, and collapse runs of whitespace to one space.
    """

    name = "exact_match"

    def __init__(self, *, extract: Literal["none", "boxed", "last_line"] = "none",
                 case_sensitive: bool = True, normalize_whitespace: bool = True) -> None:
        if extract not in ("none", "boxed", "last_line"):
            raise ValueError(f"extract must be 'none', 'boxed' or 'last_line', got {extract!r}")
        self.extract = extract
        self.case_sensitive = case_sensitive
        self.normalize_whitespace = normalize_whitespace

    def _canon(self, text: str) -> str:
        if self.normalize_whitespace:
            text = " ".join(text.split())
        return text if self.case_sensitive else text.casefold()

    async def judge(self, item: AgentRolloutItem) -> JudgeResult:
        """Compare the (extracted) answer with the accepted answers.

        Raises:
            JudgeError: the row has no ground truth.
        """
        accepted = ground_truths(item.data.ground_truth)
        text: str | None = response_text(item)
        if self.extract == "boxed":
            text = extract_boxed(text or "")
        elif self.extract == "last_line":
            lines = [line for line in (text or "").splitlines() if line.strip()]
            text = lines[-1] if lines else None
        if text is None:
            reason = f"nothing to extract ({self.extract})"
            return JudgeResult(score=0.0, payload={"extracted": None, "reason": reason})
        answer = self._canon(text)
        matched = any(answer == self._canon(truth) for truth in accepted)
        return JudgeResult(score=1.0 if matched else 0.0, payload={"extracted": text[:1000]})


@register_judger("regex")
class RegexJudger:
    """Scores an answer with a regular expression.

    With ``pattern``: the last match in the answer is found; without a ground truth the score
    is 1.0 when there is a match, otherwise 1.0 when ``group`` of the match equals the ground
    truth (or one of a list). Without ``pattern``: the row's ground truth is the pattern, and
    the score is 1.0 when it matches the answer.

    Args:
        pattern: the pattern, or None to take it from the row's ground truth.
        group: the group compared with the ground truth (index or name).
        fullmatch: the pattern must match the whole (stripped) answer instead of any part.
        flags: ``re`` flags.
    """

    name = "regex"

    def __init__(self, pattern: str | None = None, *, group: int | str = 0,
                 fullmatch: bool = False, flags: int = 0) -> None:
        self.pattern = None if pattern is None else re.compile(pattern, flags)
        self.group = group
        self.fullmatch = fullmatch
        self.flags = flags

    def _last_match(self, pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
        if self.fullmatch:
            return pattern.fullmatch(text.strip())
        last = None
        for last in pattern.finditer(text):  # noqa: B007 - keep the last one
            pass
        return last

    async def judge(self, item: AgentRolloutItem) -> JudgeResult:
        """Match the answer; see the class doc.

        Raises:
            JudgeError: no pattern and no ground truth, or an invalid pattern in the row.
        """
        text = response_text(item)
        if self.pattern is None:
            truth = item.data.ground_truth
            if not isinstance(truth, str):
                raise JudgeError("regex judger without a pattern needs the row's ground_truth "
                                 f"to be a pattern string, got {type(truth).__name__}")
            try:
                pattern = re.compile(truth, self.flags)
            except re.error as exc:
                raise JudgeError(f"the row's ground_truth is not a valid pattern: {exc}") from exc
            match = self._last_match(pattern, text)
            matched = None if match is None else match.group(0)[:1000]
            return JudgeResult(score=1.0 if match else 0.0, payload={"matched": matched})
        match = self._last_match(self.pattern, text)
        if match is None:
            return JudgeResult(score=0.0, payload={"matched": None, "reason": "no match"})
        found = match.group(self.group)
        payload: dict[str, Any] = {"matched": None if found is None else found[:1000]}
        if item.data.ground_truth is None:
            return JudgeResult(score=1.0, payload=payload)
        ok = found is not None and found.strip() in [t.strip() for t in
                                                     ground_truths(item.data.ground_truth)]
        return JudgeResult(score=1.0 if ok else 0.0, payload=payload)
