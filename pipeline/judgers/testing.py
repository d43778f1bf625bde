"""Helpers for testing judgers: a finished item from an answer and a row, no pipeline needed.

::

    from pipeline.judgers.testing import judge_item

    result = await MyJudger().judge(judge_item("so \\\\boxed{4}", ground_truth="4"))
"""

from __future__ import annotations

from typing import Any

from pipeline import artifacts as A
from pipeline._data.models import AgentMessage, AgentRolloutItem
from pipeline._data.rows import parse_row


def judge_item(answer: str | None, *, ground_truth: Any = None, data_source: str = "default",
               question: str = "question", extra: dict[str, Any] | None = None,
               uid: str = "test-0") -> AgentRolloutItem:
    """An item as a judger sees it after generation: the question and the model's answer.

    Args:
        answer: the final assistant message's text (None: no assistant message at all).
        ground_truth: the row's field.
        data_source: the row's field.
        extra: the row's field.
        question: the user message.
        uid: the item's uid (its group id is the part before the last ``-``).
    """
    row = parse_row({"prompt": question, "ground_truth": ground_truth,
                     "data_source": data_source, "extra": extra or {}})
    messages = [AgentMessage(role="user", content=question)]
    if answer is not None:
        messages.append(AgentMessage(role="assistant", content=answer))
    return AgentRolloutItem(uid=uid, group_id=uid.rsplit("-", 1)[0], data=row,
                            artifacts={A.MESSAGES: messages})
