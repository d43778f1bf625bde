"""Prompt tokenization in batches, off the event loop.

Tokenizing a short chat prompt costs about 70 us of the event loop's time with a Hugging Face
fast tokenizer, and with thousands of samples starting at once that is most of what delays
the last request's submission to the engine. :class:`BatchEncoder` collects the texts that
samples ask for during one loop iteration and encodes them together with the Rust tokenizer's
``encode_batch`` in a worker thread: it releases the GIL and spreads the batch over the
machine's cores, so the loop goes on submitting while the prompts are tokenized.

Only for tokenizers where that is provably the same as ``tokenizer.encode(text,
add_special_tokens=False)`` (see :func:`pipeline._text.render.plain_fast_backend`); other
tokenizers encode inline as before.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from pipeline._text.render import plain_fast_backend
from pipeline._text.tokenizer import Tokenizer

Waiters = dict[str, list[asyncio.Future[list[int]]]]
"""The texts of one batch and the futures of the callers waiting for each."""


class BatchEncoder:
    """Encodes texts for one Rust tokenizer on one event loop, a batch per loop iteration.

    Identical texts in one batch are encoded once (the ``n`` samples of a group share their
    prompt). Each caller awaits a future of its own, so cancelling one sample cancels nobody
    else's encoding. It holds no reference to its loop, so the registry's entry goes with
    the loop.
    """

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._pending: Waiters = {}

    async def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens added."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[int]] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.setdefault(text, []).append(future)
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, {}
        try:
            done = asyncio.get_running_loop().run_in_executor(None, self._encode_all,
                                                              list(batch))
        except Exception as exc:  # the loop's executor is shut down: callers encode inline
            _fail(batch, exc)
            return
        done.add_done_callback(lambda finished: _deliver(batch, finished))

    def _encode_all(self, texts: list[str]) -> list[list[int]]:
        # ``ids`` is a new list per call already: no second copy in this GIL-holding loop.
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]


def _deliver(batch: Waiters, finished: asyncio.Future[list[list[int]]]) -> None:
    error = None if finished.cancelled() else finished.exception()
    if finished.cancelled() or error is not None:
        _fail(batch, error or RuntimeError("tokenizing the prompts was cancelled"))
        return
    for ids, futures in zip(finished.result(), batch.values(), strict=True):
        for future in futures:  # one list per text: callers copy what they keep
            if not future.done():
                future.set_result(ids)


def _fail(batch: Waiters, error: BaseException) -> None:
    for futures in batch.values():
        for future in futures:
            if not future.done():
                future.set_exception(error)


_ENCODERS: weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, BatchEncoder]] = (
    weakref.WeakKeyDictionary())


def batch_encoder(tokenizer: Tokenizer) -> BatchEncoder | None:
    """The running loop's batch encoder for ``tokenizer``, or None where it has no plain fast
    backend (or cannot be weakly referenced): encode inline then."""
    backend = plain_fast_backend(tokenizer, encoding=True)
    if backend is None:
        return None
    loop = asyncio.get_running_loop()
    try:
        per_loop = _ENCODERS.get(loop)
        if per_loop is None:
            per_loop = _ENCODERS[loop] = weakref.WeakKeyDictionary()
        encoder = per_loop.get(tokenizer)
        if encoder is None:
            encoder = per_loop[tokenizer] = BatchEncoder(backend)
    except TypeError:  # a tokenizer that cannot be weakly referenced
        return None
    return encoder
