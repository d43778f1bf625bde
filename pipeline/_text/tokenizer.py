"""The tokenizer protocol: what stages need from a tokenizer (a Hugging Face one fits)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """The subset of a Hugging Face tokenizer the built-in stages use."""

    pad_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str:
        """Text of ``token_ids``."""
        ...

    def apply_chat_template(self, conversation: Sequence[dict[str, Any]], **kwargs: Any) -> Any:
        """Render a conversation (``tokenize=False`` gives the text)."""
        ...
