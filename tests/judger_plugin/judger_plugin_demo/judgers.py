"""A third-party judger. It imports nothing from ``pipeline``: a judger is just a shape."""

from typing import Any


class LengthJudger:
    """Scores 1.0 when the answer is at most ``max_chars`` long."""

    name = "demo_length"

    def __init__(self, max_chars: int = 10) -> None:
        self.max_chars = max_chars

    async def judge(self, item: Any) -> dict[str, Any]:
        text = item.artifacts["messages"][-1].content or ""
        return {"score": float(len(text) <= self.max_chars), "length": len(text)}
