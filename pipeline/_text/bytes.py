"""``ByteTokenizer``: a real (if simple) tokenizer needing no model files.

Every UTF-8 byte is one token, plus three special tokens, with a ChatML chat template. Unit
tests, the simulated-engine scenarios and ``make_engine("simulated")`` without a model
directory use it; :mod:`pipeline.testing` is its public home.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any


class ByteTokenizer:
    """Byte-level tokenizer with ChatML specials: ``<|endoftext|>``=0 (pad), ``<|im_start|>``=1,
    ``<|im_end|>``=2 (eos); byte ``b`` is token ``b + 3``."""

    special_tokens = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    pad_token_id: int | None = 0
    eos_token_id: int | None = 2
    vocab_size = 259
    _split = re.compile("(" + "|".join(re.escape(t) for t in special_tokens) + ")")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings become their ids."""
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self.special_tokens:
                ids.append(self.special_tokens.index(part))
            elif part:
                ids.extend(b + 3 for b in part.encode("utf-8"))
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids`` (invalid UTF-8 is replaced, never raised)."""
        out = bytearray()
        for tok in token_ids:
            if tok >= 3:
                out.append(tok - 3)
            elif not skip_special_tokens:
                out.extend(self.special_tokens[tok].encode())
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        conversation: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **_: Any,
    ) -> str | list[int]:
        """ChatML rendering; tool schemas go in a leading system block."""
        parts = []
        if tools:
            schemas = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
            parts.append(f"<|im_start|>system\n# Tools\n{schemas}<|im_end|>\n")
        for msg in conversation:
            content = msg.get("content") or ""
            if not isinstance(content, str):
                content = "".join(p.get("text", "") for p in content)
            parts.append(f"<|im_start|>{msg['role']}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        text = "".join(parts)
        return self.encode(text) if tokenize else text
