"""A reply's logprobs as OpenAI's API writes them (``logprobs.content``): each sampled
token's piece, logprob and own bytes, read from the tokenizer's vocabulary where a token holds
part of a UTF-8 character."""

from __future__ import annotations

import re
from typing import Any

from pipeline._text.tokenizer import Tokenizer


class TokenLogprobs:
    """The logprob entries of one proxy's replies, with each token's bytes cached (at most
    about a million tokens)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes | None] = {}

    def entries(self, tokens: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        """OpenAI's ``logprobs.content`` entries of a reply: one per sampled token, with its
        piece, logprob and bytes (no alternatives: the engine returns the sampled one)."""
        out = []
        for token, logprob in zip(tokens, logprobs, strict=True):
            piece = self.tokenizer.decode([token], skip_special_tokens=False)
            raw = self.token_bytes(token, piece)
            out.append({"token": piece, "logprob": logprob,
                        "bytes": None if raw is None else list(raw), "top_logprobs": []})
        return out

    def token_bytes(self, token: int, piece: str) -> bytes | None:
        """The token's own bytes, so that concatenating them gives the reply's UTF-8 even
        where a token holds part of a character (its decoded piece is then U+FFFD). None
        for special tokens, which are not part of the text."""
        cached = self._bytes.get(token)
        if cached is not None or token in self._bytes:
            return cached
        raw: bytes | None
        if not self.tokenizer.decode([token], skip_special_tokens=True) and piece:
            raw = None  # a special token (end of turn, ...)
        else:
            raw = _raw_token_bytes(self.tokenizer, token, piece)
        if len(self._bytes) < 1 << 20:
            self._bytes[token] = raw
        return raw


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte is written as -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _raw_token_bytes(tokenizer: Tokenizer, token: int, piece: str) -> bytes:
    """A token's bytes: byte-level BPE and SentencePiece byte-fallback vocabularies are read
    from the token's vocabulary string; otherwise the decoded piece stands for it."""
    if "\ufffd" not in piece:
        return piece.encode()
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    name = convert(token) if convert is not None else None
    if isinstance(name, str):
        if all(c in _BYTE_DECODER for c in name):
            return bytes(_BYTE_DECODER[c] for c in name)
        fallback = _BYTE_FALLBACK.fullmatch(name)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
    byte_of = getattr(tokenizer, "token_bytes", None)  # a tokenizer that can tell directly
    if callable(byte_of):
        return bytes(byte_of(token))
    return piece.encode()
