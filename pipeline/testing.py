"""Helpers for testing stages and judgers: a byte-level tokenizer and the simulated engine.

``ByteTokenizer`` is a real (if simple) tokenizer: every UTF-8 byte is one token, plus three
special tokens, with a ChatML chat template. It needs no model files, so unit tests and the
simulated-engine scenarios run anywhere; real-model tests use a Hugging Face tokenizer.
"""

from __future__ import annotations

from structlog.testing import capture_logs

from pipeline._text.bytes import ByteTokenizer
from pipeline.engines import SimulatedEngine
from pipeline.judgers.testing import judge_item

__all__ = ["ByteTokenizer", "SimulatedEngine", "capture_logs", "judge_item"]
