"""Prompt tokenizing in batches off the event loop (``pipeline._text.encode``), with the real
tiny-model tokenizer: the same ids as ``tokenizer.encode``, one rendering per group, each
caller's cancellation its own, and a failing batch falls back to encoding inline."""

from __future__ import annotations

import asyncio

import pytest

import pipeline.stages._prompt as prompt_module
from pipeline import BuildPrompt, Pipeline, Status
from pipeline._text.encode import BatchEncoder, batch_encoder
from pipeline._text.render import render_prompt
from pipeline.testing import ByteTokenizer

pytest_plugins = ["_model_fixtures"]

ROWS = [{"messages": [{"role": "system", "content": "Be brief." * (i % 3)},
                      {"role": "user", "content": f"What is {i} + {i * 7}? ünïcode {i}"}]}
        for i in range(40)]


@pytest.mark.parametrize("offload", [True, False])
async def test_prompt_ids_equal_inline_tokenizing_in_groups(tiny_tokenizer, offload,
                                                            monkeypatch):
    renders = []
    real_render = prompt_module.render
    monkeypatch.setattr(prompt_module, "render",
                        lambda *a, **k: renders.append(1) or real_render(*a, **k))
    pipe = Pipeline([BuildPrompt(offload=offload)], tokenizer=tiny_tokenizer)
    result = await pipe.run_batch(ROWS, n=3)
    assert [s.status for s in result.samples] == [Status.COMPLETED] * 120
    for i, sample in enumerate(result.samples):
        expected = render_prompt(tiny_tokenizer, ROWS[i // 3]["messages"], None)[1]
        assert sample.prompt_ids == expected
    assert len(renders) == len(ROWS)  # once per group, not per sample


async def test_batches_per_loop_iteration_and_cancelling_one_caller_spares_the_rest(
        tiny_tokenizer):
    encoder = batch_encoder(tiny_tokenizer)
    assert isinstance(encoder, BatchEncoder)
    assert batch_encoder(tiny_tokenizer) is encoder
    assert batch_encoder(ByteTokenizer()) is None  # not a fast tokenizer: inline
    batches = []
    real = encoder._encode_all
    encoder._encode_all = lambda texts: batches.append(len(texts)) or real(texts)
    text = "<|im_start|>user\nhello there<|im_end|>\n"
    first = asyncio.create_task(encoder.encode(text))
    doomed = asyncio.create_task(encoder.encode(text))
    other = asyncio.create_task(encoder.encode("something else"))
    await asyncio.sleep(0)
    doomed.cancel()
    assert await first == tiny_tokenizer.encode(text, add_special_tokens=False)
    assert await other == tiny_tokenizer.encode("something else", add_special_tokens=False)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert batches == [2]  # one batch, the shared text encoded once


async def test_a_failing_batch_falls_back_to_inline_tokenizing(tiny_tokenizer):
    encoder = batch_encoder(tiny_tokenizer)

    def broken(texts):
        raise RuntimeError("Already borrowed")

    encoder._encode_all = broken
    with pytest.raises(RuntimeError, match="Already borrowed"):
        await encoder.encode("x")
    result = await Pipeline([BuildPrompt()], tokenizer=tiny_tokenizer).run_batch(ROWS[:4])
    assert [s.prompt_ids for s in result.samples] == [
        render_prompt(tiny_tokenizer, row["messages"], None)[1] for row in ROWS[:4]]


async def test_an_executor_that_is_gone_fails_the_batch_not_the_samples(tiny_tokenizer):
    loop = asyncio.get_running_loop()
    encoder = batch_encoder(tiny_tokenizer)

    def refuse(*args):
        raise RuntimeError("Executor shutdown has been called")

    loop.run_in_executor = refuse  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="shutdown"):
            await asyncio.wait_for(encoder.encode("x"), 5)  # failed, never left hanging
        result = await Pipeline([BuildPrompt()], tokenizer=tiny_tokenizer).run_batch(ROWS[:2])
        assert [s.status for s in result.samples] == [Status.COMPLETED] * 2
    finally:
        del loop.run_in_executor


def test_tokenizers_whose_encode_differs_from_the_rust_one_encode_inline(tiny_model_dir):
    from transformers import AutoTokenizer

    from pipeline._text.render import plain_fast_backend

    def fresh():
        return AutoTokenizer.from_pretrained(tiny_model_dir)

    assert plain_fast_backend(fresh(), encoding=True) is not None
    wrapped = fresh()
    wrapped.encode = lambda text, **kw: [7]  # an instance override is honoured
    splitting = fresh()
    splitting.split_special_tokens = True
    truncating = fresh()
    truncating._tokenizer.enable_truncation(max_length=4)  # encode() would switch it off
    for tokenizer in (wrapped, splitting, truncating):
        assert plain_fast_backend(tokenizer, encoding=True) is None
        assert batch_encoder(tokenizer) is None
    decoding = fresh()
    decoding.decode = lambda ids, **kw: "mine"
    assert plain_fast_backend(decoding) is None
